// The planned allocator (docs/method.md §5 at the allocator, where every allocation is seen). One core logs each
// training step's allocations (size, order, when each is freed) and, once Python has solved the step's Dynamic
// Storage Allocation problem, serves the k-th request of every later step at base + offset[k] inside one arena
// (a request may take a same-sized entry a few places ahead: intra-op threads allocate their buffers in either
// order). Anything it cannot vouch for passes through to a backend allocator: a request whose size differs from
// the plan (the rest of that step then passes through and Python plans anew), a region still held by a tensor
// freed later than recorded (a collision avoided), a tensor that outlived its recorded step (a survivor), a
// request on another stream than the step's, or anything outside a step. It costs memory, never correctness.
//
// The same core serves two front ends:
// - CPU: it replaces PyTorch's CPU allocator (c10::SetCPUAllocator); the backend is PyTorch's default one.
// - CUDA: `memo_device_malloc` / `memo_device_free` are the functions torch.cuda.memory.CUDAPluggableAllocator
//   loads; the backend is the CUDA runtime's stream-ordered allocator (cudaMallocAsync / cudaFreeAsync, whose
//   addresses Python passes in). Only requests on the step's stream are planned, so a region is reused in that
//   stream's order, as the caching allocator reuses blocks; side streams use memo's persistent buffers only.
//   `memo_host_alloc` / `memo_host_free` stand in for the CUDA runtime so the CPU tests run this path.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <c10/core/CPUAllocator.h>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
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

// Where pass-throughs and the arena come from.
struct Backend {
  virtual ~Backend() = default;
  virtual void* alloc(size_t n, void* stream) = 0;
  virtual void release(void* data, void* stream) = 0;
  virtual void trim() {}
};

struct CpuBackend final : Backend {
  c10::Allocator* host = c10::GetDefaultCPUAllocator();
  void* alloc(size_t n, void*) override {
    return host->raw_allocate(n);
  }
  void release(void* data, void*) override {
    host->raw_deallocate(data);
  }
  void trim() override {  // pages a recorded step left in malloc's free lists go back to the system
#ifdef __GLIBC__
    malloc_trim(0);
#endif
  }
};

// A device allocator given as C functions with cudaMallocAsync's and cudaFreeAsync's signatures.
struct FunctionBackend final : Backend {
  using AllocFn = int (*)(void** data, size_t n, void* stream);
  using FreeFn = int (*)(void* data, void* stream);
  AllocFn alloc_fn;
  FreeFn free_fn;
  FunctionBackend(int64_t alloc_address, int64_t free_address)
      : alloc_fn(reinterpret_cast<AllocFn>(alloc_address)), free_fn(reinterpret_cast<FreeFn>(free_address)) {}
  void* alloc(size_t n, void* stream) override {
    void* data = nullptr;
    return alloc_fn(&data, n, stream) == 0 ? data : nullptr;
  }
  void release(void* data, void* stream) override {
    free_fn(data, stream);
  }
};

class Core {
 public:
  explicit Core(std::unique_ptr<Backend> backend) : backend_(std::move(backend)) {}

  void* request(size_t n, void* stream) {
    std::lock_guard<std::mutex> guard(mutex_);
    if (n == 0) {
      return nullptr;
    }
    if (!in_step_ || stream != stream_) {
      return pass(n, -1, stream);
    }
    const int64_t k = static_cast<int64_t>(log_.size());
    log_.push_back({static_cast<int64_t>(n), clock_++, kNever});
    if (!serving_ || derailed_) {
      return pass(n, k, stream);
    }
    const int64_t j = match(static_cast<int64_t>(n));
    if (j < 0) {
      derailed_ = true;  // another step shape: the rest passes through, and Python plans anew
      ++misses_;
      return pass(n, k, stream);
    }
    const int64_t offset = offsets_[j];
    if (offset < 0) {
      return pass(n, k, stream);  // recorded as outliving its step
    }
    if (overlaps_live(offset, offset + static_cast<int64_t>(n))) {
      ++collisions_;  // a tensor freed later than recorded still holds part of the region
      return pass(n, k, stream);
    }
    live_[offset] = offset + static_cast<int64_t>(n);
    ++served_;
    void* data = base_ + offset;
    held_.emplace(data, Held{step_, k, offset, static_cast<int64_t>(n), stream});
    return data;
  }

  void give_back(void* data) {
    if (data == nullptr) {
      return;
    }
    std::lock_guard<std::mutex> guard(mutex_);
    auto found = held_.find(data);
    TORCH_INTERNAL_ASSERT(found != held_.end(), "a pointer the planned allocator never handed out");
    const Held held = found->second;
    held_.erase(found);
    if (in_step_ && held.step == step_ && held.request >= 0) {
      log_[held.request].freed = clock_++;
    }
    if (held.offset >= 0) {
      live_.erase(held.offset);
    } else {
      pass_live_ -= held.size;
      backend_->release(data, held.stream);
    }
  }

  void begin_step(int64_t stream) {
    std::lock_guard<std::mutex> guard(mutex_);
    log_.clear();
    clock_ = 0;
    ++step_;
    derailed_ = false;
    in_step_ = true;
    stream_ = reinterpret_cast<void*>(stream);
    cursor_ = 0;
    used_.assign(sizes_.size(), false);
  }

  // Ends the step; returns whether it was recorded rather than served (no plan yet, or it left the plan).
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
      drop_arena();  // the old arena goes before the new one comes: never both
      base_ = static_cast<char*>(backend_->alloc(static_cast<size_t>(arena_bytes), stream_));
      TORCH_CHECK(base_ != nullptr, "cannot allocate the planned arena of ", arena_bytes, " bytes");
      arena_bytes_ = arena_bytes;
    }
    sizes_ = sizes;
    offsets_ = offsets;
    serving_ = true;
    backend_->trim();
    return true;
  }

  // Forgets the plan (a new run, or a step that left it), and its arena unless tensors still live in it.
  void forget_plan() {
    std::lock_guard<std::mutex> guard(mutex_);
    serving_ = false;
    sizes_.clear();
    offsets_.clear();
    if (live_.empty()) {
      drop_arena();
      backend_->trim();
    }
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
    void* stream;
  };

  void* pass(size_t n, int64_t k, void* stream) {  // under mutex_
    void* data = backend_->alloc(n, stream);
    if (data == nullptr) {
      return nullptr;
    }
    ++passed_;
    pass_live_ += static_cast<int64_t>(n);
    pass_peak_ = std::max(pass_peak_, pass_live_);
    held_.emplace(data, Held{step_, k, -1, static_cast<int64_t>(n), stream});
    return data;
  }

  void drop_arena() {  // under mutex_
    if (base_ != nullptr) {
      backend_->release(base_, stream_);
    }
    base_ = nullptr;
    arena_bytes_ = 0;
  }

  // Returns the plan entry a request of `n` bytes takes: the first unused one of that size among the next
  // kWindow, or -1 (a miss).
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

  std::unique_ptr<Backend> backend_;
  std::mutex mutex_;
  bool in_step_ = false, serving_ = false, derailed_ = false;
  void* stream_ = nullptr;  // the stream the current step's planned requests come on
  std::vector<Request> log_;
  int64_t clock_ = 0, step_ = 0;
  std::vector<int64_t> sizes_, offsets_;
  std::vector<bool> used_;  // plan entries taken in this step
  int64_t cursor_ = 0;      // the first plan entry not yet taken
  char* base_ = nullptr;
  int64_t arena_bytes_ = 0;
  std::map<int64_t, int64_t> live_;       // served regions now alive: start -> end
  std::unordered_map<void*, Held> held_;  // every pointer handed out and not yet freed
  int64_t served_ = 0, misses_ = 0, collisions_ = 0, passed_ = 0, pass_live_ = 0, pass_peak_ = 0;
};

// Both cores live for the process: tensors they handed out may outlive any Python handle.
Core* cpu_core = nullptr;
Core* device_core = nullptr;

void free_cpu(void* data) {
  cpu_core->give_back(data);
}

// PyTorch's CPU allocator interface over the core; every pointer is "simple" (its context is itself, freed by
// `raw_deleter()`), as kernels that call raw_allocate need.
struct CpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* data = cpu_core->request(n, nullptr);
    return {data, data, &free_cpu, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &free_cpu;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CpuAllocator* cpu_allocator = nullptr;

Core& core(const std::string& which) {
  Core* found = which == "cpu" ? cpu_core : which == "device" ? device_core : nullptr;
  TORCH_CHECK(found != nullptr, "the planned allocator for ", which, " is not installed");
  return *found;
}

void install_cpu() {
  if (cpu_core == nullptr) {
    cpu_core = new Core(std::make_unique<CpuBackend>());
    cpu_allocator = new CpuAllocator();
  }
  cpu_core->forget_plan();
  c10::SetCPUAllocator(cpu_allocator, /*priority=*/100);
}

void uninstall_cpu() {
  c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), /*priority=*/100);
}

void make_device_core(int64_t alloc_address, int64_t free_address) {
  TORCH_CHECK(device_core == nullptr, "the device's planned allocator is made once per process");
  device_core = new Core(std::make_unique<FunctionBackend>(alloc_address, free_address));
}

}  // namespace

// The functions torch.cuda.memory.CUDAPluggableAllocator calls.
extern "C" void* memo_device_malloc(ssize_t size, int /*device*/, void* stream) {
  return device_core->request(static_cast<size_t>(size), stream);
}

extern "C" void memo_device_free(void* data, size_t /*size*/, int /*device*/, void* /*stream*/) {
  device_core->give_back(data);
}

// Host stand-ins with the CUDA runtime's signatures, so that the CPU tests run the device path.
extern "C" int memo_host_alloc(void** data, size_t n, void* /*stream*/) {
  *data = std::malloc(n);
  return *data == nullptr ? 2 : 0;  // 2: cudaErrorMemoryAllocation
}

extern "C" int memo_host_free(void* data, void* /*stream*/) {
  std::free(data);
  return 0;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install_cpu", &install_cpu, "route CPU allocations through the planned allocator");
  m.def("uninstall_cpu", &uninstall_cpu, "route CPU allocations back to PyTorch's default allocator");
  m.def("make_device_core", &make_device_core, "the device core over C allocation functions at these addresses");
  m.def("begin_step", [](const std::string& which, int64_t stream) { core(which).begin_step(stream); });
  m.def("end_step", [](const std::string& which) { return core(which).end_step(); });
  m.def("log", [](const std::string& which) { return core(which).log(); });
  m.def("set_plan", [](const std::string& which, const std::vector<int64_t>& sizes,
                       const std::vector<int64_t>& offsets, int64_t bytes) {
    return core(which).set_plan(sizes, offsets, bytes);
  });
  m.def("forget_plan", [](const std::string& which) { core(which).forget_plan(); });
  m.def("counters", [](const std::string& which) { return core(which).counters(); });
  m.def("reset_peak", [](const std::string& which) { core(which).reset_peak(); });
}
