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
//   loads; the backend is the CUDA runtime's stream-ordered allocator (cudaMallocAsync / cudaFreeAsync from the
//   device's default memory pool, or cudaMalloc / cudaFree on a GPU without memory pools), called at addresses
//   Python finds in the runtime torch loaded, so that this file builds without the CUDA toolkit. Only requests on
//   the step's stream are planned, so a region is reused in that stream's order, as the caching allocator reuses
//   blocks; side streams use memo's persistent buffers only. The CPU tests give host stand-ins for the runtime.
// A request the backend cannot serve raises torch.OutOfMemoryError: PyTorch's allocator calls
// `memo_device_malloc` from C++ (torch/csrc/cuda/Module.cpp `_cuda_customAllocator` wraps its address in a
// std::function that torch/csrc/cuda/CUDAPluggableAllocator.cpp `malloc` calls), so the exception unwinds to the
// op's Python binding, which translates c10::OutOfMemoryError as it does the caching allocator's.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <c10/core/CPUAllocator.h>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
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
  virtual void use_device(int /*device*/) {}       // before a request of that device is served
  virtual void* alloc(size_t n, void* stream) = 0;  // nullptr when out of memory
  virtual void release(void* data, void* stream) = 0;
  virtual void trim() {}
  virtual std::map<std::string, int64_t> pool(bool /*reset_peaks*/) {  // empty: no pool to ask
    return {};
  }
};

struct CpuBackend final : Backend {
  c10::Allocator* host = c10::GetDefaultCPUAllocator();
  void* alloc(size_t n, void*) override {
    return host->raw_allocate(n);  // PyTorch's CPU allocator raises rather than return nullptr
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

// Values from CUDA's driver_types.h (the same since CUDA 11.3).
constexpr int kCudaSuccess = 0, kCudaErrorMemoryAllocation = 2;
constexpr int kDevAttrMemoryPoolsSupported = 115;
constexpr int kPoolReleaseThreshold = 4, kPoolReservedCurrent = 5, kPoolReservedHigh = 6, kPoolUsedCurrent = 7,
              kPoolUsedHigh = 8;

// The CUDA runtime functions the device backend calls, with the runtime's signatures (cudaError_t and the enums
// are ints), at the addresses Python passes by name.
struct CudaRuntime {
  int (*cudaMallocAsync)(void**, size_t, void*);
  int (*cudaFreeAsync)(void*, void*);
  int (*cudaMalloc)(void**, size_t);
  int (*cudaFree)(void*);
  int (*cudaGetLastError)();
  const char* (*cudaGetErrorString)(int);
  int (*cudaDeviceGetAttribute)(int*, int, int);
  int (*cudaDeviceGetDefaultMemPool)(void**, int);
  int (*cudaMemPoolSetAttribute)(void*, int, void*);
  int (*cudaMemPoolGetAttribute)(void*, int, void*);

  explicit CudaRuntime(const std::map<std::string, int64_t>& at) {
    bind(at, "cudaMallocAsync", cudaMallocAsync);
    bind(at, "cudaFreeAsync", cudaFreeAsync);
    bind(at, "cudaMalloc", cudaMalloc);
    bind(at, "cudaFree", cudaFree);
    bind(at, "cudaGetLastError", cudaGetLastError);
    bind(at, "cudaGetErrorString", cudaGetErrorString);
    bind(at, "cudaDeviceGetAttribute", cudaDeviceGetAttribute);
    bind(at, "cudaDeviceGetDefaultMemPool", cudaDeviceGetDefaultMemPool);
    bind(at, "cudaMemPoolSetAttribute", cudaMemPoolSetAttribute);
    bind(at, "cudaMemPoolGetAttribute", cudaMemPoolGetAttribute);
  }

  template <typename F>
  static void bind(const std::map<std::string, int64_t>& at, const char* name, F& fn) {
    auto found = at.find(name);
    TORCH_CHECK(found != at.end() && found->second != 0, "the device core needs the address of ", name);
    fn = reinterpret_cast<F>(found->second);
  }

  // Raises on a CUDA error, clearing it first so that the next kernel launch check does not report it again.
  void check(int err, const char* call) const {
    if (err != kCudaSuccess) {
      (void)cudaGetLastError();
      TORCH_CHECK(false, call, " failed: ", cudaGetErrorString(err));
    }
  }
};

// The device backend: the default memory pool of the device, cudaMalloc / cudaFree where it has none.
struct CudaBackend final : Backend {
  explicit CudaBackend(const std::map<std::string, int64_t>& functions) : rt_(functions) {}

  // Sets up the device at its first request: the core serves one GPU per process, as PyTorch's allocator calls it.
  void use_device(int device) override {
    if (device == device_) {
      return;
    }
    TORCH_CHECK(device_ < 0, "the planned allocator serves one GPU per process: cuda:", device_, ", not cuda:", device);
    int pools = 0;
    rt_.check(rt_.cudaDeviceGetAttribute(&pools, kDevAttrMemoryPoolsSupported, device), "cudaDeviceGetAttribute");
    if (pools != 0) {
      void* pool = nullptr;
      rt_.check(rt_.cudaDeviceGetDefaultMemPool(&pool, device), "cudaDeviceGetDefaultMemPool");
      // The pool keeps what is freed instead of unmapping it at every synchronization (its default threshold is
      // 0), as PyTorch's c10/cuda/CUDAMallocAsyncAllocator.cpp sets it in lazy_init_device.
      uint64_t keep = UINT64_MAX;
      rt_.check(rt_.cudaMemPoolSetAttribute(pool, kPoolReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
      pool_ = pool;
    }
    device_ = device;
  }

  void* alloc(size_t n, void* stream) override {
    TORCH_INTERNAL_ASSERT(device_ >= 0, "a device allocation before the core met its device");
    void* data = nullptr;
    const int err = pool_ != nullptr ? rt_.cudaMallocAsync(&data, n, stream) : rt_.cudaMalloc(&data, n);
    if (err == kCudaErrorMemoryAllocation) {
      (void)rt_.cudaGetLastError();  // as c10/cuda/CUDAMallocAsyncAllocator.cpp's mallocAsync: a caught OOM may retry
      return nullptr;
    }
    rt_.check(err, pool_ != nullptr ? "cudaMallocAsync" : "cudaMalloc");
    return data;
  }

  void release(void* data, void* stream) override {  // a deleter cannot raise: a failed free shows at the next check
    if (pool_ != nullptr) {
      (void)rt_.cudaFreeAsync(data, stream);
    } else {
      (void)rt_.cudaFree(data);
    }
  }

  // The pool's bytes (current and high-water marks), after resetting the marks to the current values if asked:
  // setting a mark to 0 does that (c10/cuda/CUDAMallocAsyncAllocator.cpp resetPeakStats).
  std::map<std::string, int64_t> pool(bool reset_peaks) override {
    if (pool_ == nullptr) {
      return {};
    }
    if (reset_peaks) {
      for (int attr : {kPoolReservedHigh, kPoolUsedHigh}) {
        uint64_t zero = 0;
        rt_.check(rt_.cudaMemPoolSetAttribute(pool_, attr, &zero), "cudaMemPoolSetAttribute");
      }
    }
    std::map<std::string, int64_t> bytes;
    for (const auto& [name, attr] : {std::pair<const char*, int>{"reserved", kPoolReservedCurrent},
                                     {"reserved_peak", kPoolReservedHigh},
                                     {"used", kPoolUsedCurrent},
                                     {"used_peak", kPoolUsedHigh}}) {
      uint64_t value = 0;
      rt_.check(rt_.cudaMemPoolGetAttribute(pool_, attr, &value), "cudaMemPoolGetAttribute");
      bytes[name] = static_cast<int64_t>(value);
    }
    return bytes;
  }

 private:
  CudaRuntime rt_;
  int device_ = -1;
  void* pool_ = nullptr;  // the device's default memory pool; nullptr where it has none
};

class Core {
 public:
  explicit Core(std::unique_ptr<Backend> backend) : backend_(std::move(backend)) {}

  void* request(size_t n, int device, void* stream) {
    std::lock_guard<std::mutex> guard(mutex_);
    if (n == 0) {
      return nullptr;
    }
    backend_->use_device(device);
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
    serving_ = false;  // until the plan's arena is in place
    if (arena_bytes != arena_bytes_) {
      if (!live_.empty()) {
        return false;
      }
      drop_arena();  // the old arena goes before the new one comes: never both
      if (arena_bytes > 0) {
        base_ = static_cast<char*>(backend_->alloc(static_cast<size_t>(arena_bytes), stream_));
        if (base_ == nullptr) {
          out_of_memory(arena_bytes, "the planned arena");
        }
      }
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

  // The backend's memory pool in bytes (empty: none), its high-water marks first reset if asked.
  std::map<std::string, int64_t> pool(bool reset_peaks) {
    std::lock_guard<std::mutex> guard(mutex_);
    return backend_->pool(reset_peaks);
  }

  // Whether it holds no memory: then nothing it handed out can outlive it.
  bool idle() {
    std::lock_guard<std::mutex> guard(mutex_);
    return held_.empty() && base_ == nullptr;
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
      out_of_memory(static_cast<int64_t>(n), "a request");
    }
    ++passed_;
    pass_live_ += static_cast<int64_t>(n);
    pass_peak_ = std::max(pass_peak_, pass_live_);
    held_.emplace(data, Held{step_, k, -1, static_cast<int64_t>(n), stream});
    return data;
  }

  // Raises torch.OutOfMemoryError (a null pointer would reach a kernel as an illegal address).
  [[noreturn]] void out_of_memory(int64_t n, const char* what) const {  // under mutex_
    TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory: the planned allocator could not get ", n,
                     " bytes for ", what, " (it holds an arena of ", arena_bytes_, " bytes and ", pass_live_,
                     " bytes passed through)");
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
    void* data = cpu_core->request(n, -1, nullptr);
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

// Makes the device core over the CUDA runtime functions at these addresses (by name); it replaces an earlier
// one only while that holds no memory.
void make_device_core(const std::map<std::string, int64_t>& functions) {
  TORCH_CHECK(device_core == nullptr || device_core->idle(), "the device's planned allocator still holds memory");
  auto made = new Core(std::make_unique<CudaBackend>(functions));
  delete device_core;
  device_core = made;
}

}  // namespace

// The functions torch.cuda.memory.CUDAPluggableAllocator calls (its MallocFuncType and FreeFuncType).
extern "C" void* memo_device_malloc(size_t size, int device, void* stream) {
  return device_core->request(size, device, stream);
}

extern "C" void memo_device_free(void* data, size_t /*size*/, int /*device*/, void* /*stream*/) {
  device_core->give_back(data);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install_cpu", &install_cpu, "route CPU allocations through the planned allocator");
  m.def("uninstall_cpu", &uninstall_cpu, "route CPU allocations back to PyTorch's default allocator");
  m.def("make_device_core", &make_device_core, "the device core over the CUDA runtime functions at these addresses");
  m.def("device_malloc", [](size_t n, int device, int64_t stream) {  // the C path PyTorch calls, for the CPU tests
    return reinterpret_cast<int64_t>(memo_device_malloc(n, device, reinterpret_cast<void*>(stream)));
  });
  m.def("pool", [](bool reset_peaks) {
    return device_core == nullptr ? std::map<std::string, int64_t>{} : device_core->pool(reset_peaks);
  });
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
