// The planned allocator (memo-method.md §5 at the allocator, where every allocation is seen): PyTorch's CPU
// allocator is replaced by one that logs each training step's allocations (size, order, when each is freed),
// and, once Python has solved the step's Dynamic Storage Allocation problem, serves the k-th request of every
// later step at base + offset[k] inside one arena (a request may take a same-sized entry a few places ahead:
// intra-op threads allocate their buffers in either order). Anything it cannot vouch for passes through to the default
// allocator: a request whose size differs from the plan (the rest of that step is then logged afresh and
// re-planned), a region still held by a tensor freed later than recorded (a collision avoided), a tensor that
// outlived its recorded step (a survivor), or anything outside a step. It costs memory, never correctness.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <c10/core/CPUAllocator.h>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t kNever = INT64_MAX;  // the free time of a tensor still alive when its step ended
constexpr int64_t kWindow = 16;        // how far ahead of the plan's order a request may be matched

struct Request {
  int64_t size;
  int64_t born;   // event clock at the allocation
  int64_t freed;  // event clock at the free, kNever while alive
};

class PlannedAllocator final : public c10::Allocator {
 public:
  explicit PlannedAllocator(c10::Allocator* fallback) : fallback_(fallback) {}

  // Every pointer handed out is "simple" (its context is itself, freed by `raw_deleter()`), as kernels that
  // call raw_allocate need; what each one is (arena slot or pass-through) is kept in `held_`.
  c10::DataPtr allocate(size_t n) override {
    std::lock_guard<std::mutex> guard(mutex_);
    if (n == 0) {
      return {nullptr, nullptr, &PlannedAllocator::raw_free, c10::Device(c10::DeviceType::CPU)};
    }
    if (!in_step_) {
      return pass(n, -1);
    }
    const int64_t k = static_cast<int64_t>(log_.size());
    log_.push_back({static_cast<int64_t>(n), clock_++, kNever});
    if (!serving_ || derailed_) {
      return pass(n, k);
    }
    const int64_t j = match(static_cast<int64_t>(n));
    if (j < 0) {
      derailed_ = true;  // another step shape: the rest passes through, and this step is planned anew
      ++misses_;
      return pass(n, k);
    }
    const int64_t offset = offsets_[j];
    if (offset < 0) {
      return pass(n, k);  // recorded as outliving its step
    }
    if (overlaps_live(offset, offset + static_cast<int64_t>(n))) {
      ++collisions_;  // a tensor freed later than recorded still holds part of the region
      return pass(n, k);
    }
    live_[offset] = offset + static_cast<int64_t>(n);
    ++served_;
    void* data = base_ + offset;
    held_.emplace(data, Held{step_, k, offset, static_cast<int64_t>(n), c10::DataPtr()});
    return {data, data, &PlannedAllocator::raw_free, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &PlannedAllocator::raw_free;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void begin_step() {
    std::lock_guard<std::mutex> guard(mutex_);
    log_.clear();
    clock_ = 0;
    ++step_;
    derailed_ = false;
    in_step_ = true;
    cursor_ = 0;
    used_.assign(sizes_.size(), false);
  }

  // Ends the step; returns whether its log should be planned (no plan yet, or this step left it).
  bool end_step() {
    std::lock_guard<std::mutex> guard(mutex_);
    in_step_ = false;
    return !serving_ || derailed_;
  }

  // The last step's requests as rows (size, born, freed); freed is -1 for a survivor.
  std::vector<std::vector<int64_t>> log() {
    std::lock_guard<std::mutex> guard(mutex_);
    std::vector<std::vector<int64_t>> rows;
    rows.reserve(log_.size());
    for (const auto& r : log_) {
      rows.push_back({r.size, r.born, r.freed == kNever ? -1 : r.freed});
    }
    return rows;
  }

  // Serves later steps from `offsets` (per request; -1: pass through) in an arena of `arena_bytes`. Returns
  // false, serving nothing until the next plan, when the arena must change while tensors still live in it.
  bool set_plan(const std::vector<int64_t>& sizes, const std::vector<int64_t>& offsets, int64_t arena_bytes) {
    std::lock_guard<std::mutex> guard(mutex_);
    TORCH_CHECK(sizes.size() == offsets.size(), "a plan needs one offset per request");
    if (arena_bytes != arena_bytes_) {
      if (!live_.empty()) {
        serving_ = false;
        return false;
      }
      arena_ = c10::DataPtr();  // the old arena goes before the new one comes: never both
      arena_ = fallback_->allocate(static_cast<size_t>(arena_bytes));
      base_ = static_cast<char*>(arena_.get());
      arena_bytes_ = arena_bytes;
    }
    sizes_ = sizes;
    offsets_ = offsets;
    serving_ = true;
#ifdef __GLIBC__
    malloc_trim(0);  // the pages the recorded step left in malloc's free lists go back to the system
#endif
    return true;
  }

  std::map<std::string, int64_t> counters() {
    std::lock_guard<std::mutex> guard(mutex_);
    return {{"served", served_},
            {"misses", misses_},
            {"collisions", collisions_},
            {"arena_bytes", arena_bytes_},
            {"arena_address", reinterpret_cast<int64_t>(base_)},
            {"passed", passed_},
            {"pass_live_bytes", pass_live_},
            {"pass_peak_bytes", pass_peak_},
            {"live_in_arena", static_cast<int64_t>(live_.size())}};
  }

  // Forgets the plan (a new run, or a step that left it), and its arena unless tensors still live in it;
  // tensors handed out earlier stay tracked.
  void forget_plan() {
    std::lock_guard<std::mutex> guard(mutex_);
    serving_ = false;
    sizes_.clear();
    offsets_.clear();
    if (live_.empty()) {
      arena_ = c10::DataPtr();
      base_ = nullptr;
      arena_bytes_ = 0;
#ifdef __GLIBC__
      malloc_trim(0);
#endif
    }
  }

  void reset_peak() {
    std::lock_guard<std::mutex> guard(mutex_);
    pass_peak_ = pass_live_;
  }

 private:
  struct Held {
    int64_t step;     // the step it was allocated in: only a free in that same step is logged
    int64_t request;  // index in its step's log (-1: outside a step)
    int64_t offset;   // in the arena; -1 for a pass-through
    int64_t size;
    c10::DataPtr inner;  // a pass-through's memory from the default allocator
  };

  c10::DataPtr pass(size_t n, int64_t k) {  // under mutex_
    c10::DataPtr inner = fallback_->allocate(n);
    void* data = inner.get();
    ++passed_;
    pass_live_ += static_cast<int64_t>(n);
    pass_peak_ = std::max(pass_peak_, pass_live_);
    held_.emplace(data, Held{step_, k, -1, static_cast<int64_t>(n), std::move(inner)});
    return {data, data, &PlannedAllocator::raw_free, c10::Device(c10::DeviceType::CPU)};
  }

  // Returns the plan entry a request of `n` bytes takes: the first unused one of that size among the next
  // kWindow (intra-op threads that each allocate a buffer may do so in either order), or -1 (a miss).
  int64_t match(int64_t n) {
    const int64_t end = std::min<int64_t>(cursor_ + kWindow, static_cast<int64_t>(sizes_.size()));
    for (int64_t j = cursor_; j < end; ++j) {
      if (!used_[j] && sizes_[j] == n) {
        used_[j] = true;
        while (cursor_ < static_cast<int64_t>(used_.size()) && used_[cursor_]) {
          ++cursor_;
        }
        return j;
      }
    }
    return -1;
  }

  bool overlaps_live(int64_t start, int64_t end) const {
    auto next = live_.lower_bound(start);  // the first live region starting at or after `start`
    if (next != live_.end() && next->first < end) {
      return true;
    }
    return next != live_.begin() && std::prev(next)->second > start;
  }

  static void raw_free(void* data);

  c10::Allocator* fallback_;
  std::mutex mutex_;
  bool in_step_ = false, serving_ = false, derailed_ = false;
  std::vector<Request> log_;
  int64_t clock_ = 0, step_ = 0;
  std::vector<int64_t> sizes_, offsets_;
  std::vector<bool> used_;  // plan entries taken in this step
  int64_t cursor_ = 0;      // the first plan entry not yet taken
  c10::DataPtr arena_;
  char* base_ = nullptr;
  int64_t arena_bytes_ = 0;
  std::map<int64_t, int64_t> live_;  // served regions now alive: start -> end
  std::unordered_map<void*, Held> held_;  // every pointer handed out and not yet freed
  int64_t served_ = 0, misses_ = 0, collisions_ = 0, passed_ = 0, pass_live_ = 0, pass_peak_ = 0;
};

PlannedAllocator* instance = nullptr;  // lives for the process: tensors it served may outlive any Python handle

void PlannedAllocator::raw_free(void* data) {
  if (data == nullptr) {
    return;
  }
  c10::DataPtr inner;  // a pass-through's memory, returned to the default allocator once the lock is released
  {
    std::lock_guard<std::mutex> guard(instance->mutex_);
    auto found = instance->held_.find(data);
    TORCH_INTERNAL_ASSERT(found != instance->held_.end(), "a pointer the planned allocator never handed out");
    Held& held = found->second;
    if (instance->in_step_ && held.step == instance->step_ && held.request >= 0) {
      instance->log_[held.request].freed = instance->clock_++;
    }
    if (held.offset >= 0) {
      instance->live_.erase(held.offset);
    } else {
      instance->pass_live_ -= held.size;
    }
    inner = std::move(held.inner);
    instance->held_.erase(found);
  }
}

PlannedAllocator& get() {
  TORCH_CHECK(instance != nullptr, "the planned allocator is not installed");
  return *instance;
}

void install() {
  if (instance == nullptr) {
    instance = new PlannedAllocator(c10::GetDefaultCPUAllocator());
  }
  instance->forget_plan();
  c10::SetCPUAllocator(instance, /*priority=*/100);
}

void uninstall() {
  c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), /*priority=*/100);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, "route CPU allocations through the planned allocator");
  m.def("uninstall", &uninstall, "route CPU allocations back to PyTorch's default allocator");
  m.def("begin_step", [] { get().begin_step(); });
  m.def("end_step", [] { return get().end_step(); });
  m.def("log", [] { return get().log(); });
  m.def("set_plan", [](const std::vector<int64_t>& sizes, const std::vector<int64_t>& offsets, int64_t bytes) {
    return get().set_plan(sizes, offsets, bytes);
  });
  m.def("counters", [] { return get().counters(); });
  m.def("forget_plan", [] { get().forget_plan(); });
  m.def("reset_peak", [] { get().reset_peak(); });
}
