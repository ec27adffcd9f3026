// streamalloc as PyTorch's CUDA allocator backend: a class implementing torch's whole
// allocator interface (c10::cuda::CUDACachingAllocator::CUDAAllocator, as torch's own native
// and cudaMallocAsync backends do) over libstreamalloc's C ABI, installed as torch's current
// allocator. streamalloc/torch.py builds this file on first use against the installed torch's
// headers (torch.utils.cpp_extension.load, a plain shared library, no Python module: torch's
// extension builder caches it per torch version) and calls streamalloc_torch_backend_install
// through ctypes with the path of the libstreamalloc.so the Python package loaded.
//
// libstreamalloc is not linked: install() dlopen()s the path it is given (the file ctypes has
// already loaded, so the same handle and the same allocator state as streamalloc.stats() and
// the other Python functions) and resolves every function it calls by name. The library's
// structs are mirrored field for field in lib.h, which host.cpp shares (see
// crates/streamalloc-capi/include/streamalloc.h).
//
// What each of torch's methods does here:
//   allocate / raw_alloc*           streamalloc_allocate on torch's current stream; failure from
//                                   lack of memory (or the memory fraction) calls torch's OOM
//                                   observers and throws c10::OutOfMemoryError
//                                   (torch.cuda.OutOfMemoryError) with the library's diagnostic
//   raw_delete / the deleter        streamalloc_free, with the allocation's device and stream
//   recordStream                    streamalloc_record_stream (ignored, as native does, for
//                                   memory not deleted by this allocator: IPC-sent storages)
//   emptyCache                      streamalloc_torch_empty_cache (every device; not while a
//                                   private pool is active)
//   set/getMemoryFraction           streamalloc_set_memory_fraction
//   getDeviceStats                  torch's DeviceStats: allocations (current, peak, by pool
//                                   kind) from the backend's counts of torch's tensors, reserved
//                                   memory and device calls from streamalloc_stats
//   resetPeakStats                  streamalloc_reset_peak_stats and the backend's peaks
//   resetAccumulatedStats           the accumulated figures restart from 0
//   cacheInfo                       as native: the free device memory if *largest is 0, then
//                                   at least the library's largest cached block
//   getBaseAllocation               streamalloc_torch_base_allocation
//   beginAllocateToPool / end /     streamalloc_pool_begin / _end / _release, torch's filter
//   releasePool / createOrIncref    handed to the library; use counts kept as native keeps them
//   getPoolUseCount                 (a MemPool holds one, each begin one more until release)
//   checkPoolLiveAllocations        the pool's live allocations against torch's set
//   getCheckpointState /            cudagraph trees: a state lists a pool's live allocations;
//   setCheckpointPoolState          while it exists their memory is not returned to the
//                                   library when torch frees it, so that setting the state
//                                   revives exactly those addresses
//   shareIpcHandle / getIpcDevPtr   in torch's own formats, so that a process under torch's
//                                   allocator opens what this one shares and this one opens
//                                   torch's: cuMemAlloc chunks (strategy=plain, backing=chunks)
//                                   as 'c' (cudaIpcMemHandle_t), mapped memory (stitched, the
//                                   default, or segments) as 'e' (torch's expandable-segment
//                                   layout, streamalloc_ipc_export; the receiver copies file
//                                   descriptors with pidfd_getfd); the driver's pool
//                                   (strategy=async) refused with the reason. See Note [IPC
//                                   formats]
//   recordHistory / snapshot        torch's memory history (_record_memory_history, _snapshot,
//                                   _dump_snapshot, memory_viz): see "History" below
//   recordAnnotation, push/pop-     kept as native keeps them (annotations in the snapshot's
//   CompileContext, set/get-        external_annotations, the compile context and the user
//   UserMetadata                    metadata on each trace entry)
//
// History. recordHistory(enabled, context_recorder, max_entries, when, clear, skip_actions)
// keeps, per device, a ring of the newest max_entries TraceEntry (native's RingBuffer):
//   ALLOC           each allocation torch makes, with torch's context (stack) when `when` is
//                   ALLOC or ALL; the block keeps the context gathered at STATE and above
//   FREE_REQUESTED  torch freed it (context gathered at ALL, else the allocation's)
//   FREE_COMPLETED  the library may hand the memory out again. The library does not say when:
//                   for a plain free that is at once (it serves the next request on the same
//                   stream from it), so the entry follows the request. Memory used on another
//                   stream (recordStream) waits for that stream's work: its completion is
//                   recorded when an allocation reuses any of its bytes, or when the library
//                   reports nothing pending (streamalloc_stats' pending_release 0), whichever is
//                   seen first; until then the snapshot shows the block active_pending_free
//                   (tracked while history is recorded; otherwise the completion follows the
//                   request). Memory held for a cudagraph trees checkpoint completes when
//                   released.
//   OOM             an allocation refused for lack of memory (addr: the device's free bytes)
//   SNAPSHOT        a snapshot was taken (in the next snapshot's traces, as native)
// SEGMENT_ALLOC / SEGMENT_FREE / SEGMENT_MAP / SEGMENT_UNMAP are not recorded: the library's
// counters say that it called the device, not which range it got or gave back.
// snapshot() describes what the library holds as well as this side knows it. Segments are the
// device allocations (cuMemGetAddressRange) that hold torch's live allocations; each live
// allocation is an active_allocated block at its address (its size as asked for), each one
// freed by torch and not yet completed an active_pending_free block, the bytes between them
// inactive blocks. A range larger than all the library reserves is an address reservation,
// of which the span of the blocks found in it is reported (is_expandable); a block the driver
// gives no range holding it all (mapped memory, expandable=true, on an H200 with torch 2.11)
// is a segment of its own, merged with those it overlaps. Of the library's reserved bytes on
// a device, those in no segment found so (cached chunks that hold no live allocation, their
// addresses unknown here) are one more segment at address 0 holding one inactive block (it
// may hold other front ends', CuPy's, allocations too). device_traces are the rings, oldest
// first, times in Unix microseconds.
//
// Nothing here lets an exception escape into the library (the filter trampolines catch) and
// every library error becomes a c10::Error with the library's message.

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "lib.h"

namespace streamalloc_torch {

namespace CCA = c10::cuda::CUDACachingAllocator;
using c10::MempoolId_t;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatType;

// --- libstreamalloc's C ABI, resolved by name -------------------------------------------------

using namespace streamalloc_lib;

// A byte count as torch writes it ("1.50 GiB"). With snprintf, not an ostream: a backend
// built by the system's compiler may meet an older libstdc++ in the process, and formatting a
// double through its locale facets crashed there (seen on an H200 with torch 2.11).
std::string size_text(uint64_t bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    unit++;
  }
  char text[64];
  if (unit == 0) {
    std::snprintf(text, sizeof text, "%llu bytes", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(text, sizeof text, "%.2f %s", value, units[unit]);
  }
  return text;
}

using FilterFn = bool (*)(void*, cudaStream_t);
using DropFn = void (*)(void*);

struct Lib {
  int (*allocate)(size_t, int, cudaStream_t, void**) = nullptr;
  void (*free)(void*, ssize_t, int, cudaStream_t) = nullptr;
  int (*deallocate)(void*) = nullptr;
  int (*record_stream)(void*, cudaStream_t) = nullptr;
  int (*stats)(int, LibStats*) = nullptr;
  int (*reset_peak_stats)(int) = nullptr;
  int (*enable_peer_access)(int, int) = nullptr;
  const char* (*last_error)() = nullptr;
  int (*pool_begin)(int, uint64_t, uint64_t, FilterFn, void*, DropFn) = nullptr;
  int (*pool_end)(int, uint64_t, uint64_t) = nullptr;
  int (*pool_release)(int, uint64_t, uint64_t) = nullptr;
  int (*set_memory_fraction)(int, double) = nullptr;
  void* (*base_allocation)(void*, size_t*) = nullptr;
  void (*empty_cache)() = nullptr;
  void (*init)(int) = nullptr;
  int (*ipc_export)(void*, size_t, uint8_t*, size_t, size_t*, size_t*) = nullptr;
  int (*ipc_open)(const uint8_t*, size_t, int, void**) = nullptr;
  int (*ipc_close)(void*) = nullptr;
};

// --- the allocator ----------------------------------------------------------------------------

constexpr size_t kSmallSize = 1 << 20; // torch's small pool: requests up to 1 MiB
constexpr int kMaxDevices = 64;

// Fails (as torch's allocators do) for a device index the backend keeps no books for.
void check_device(c10::DeviceIndex device) {
  // A DeviceIndex is an int8_t, which a stream prints as a character: printed as an int.
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "streamalloc: device ", static_cast<int>(device), " out of range");
}

struct Alloc {
  size_t size = 0;
  c10::DeviceIndex device = 0;
  cudaStream_t stream = nullptr;
  bool in_pool = false; // made while a private pool's filter matched
  MempoolId_t pool{0, 0};
  std::shared_ptr<CCA::CUDAAllocator> pool_allocator; // a MemPool's own allocator, if any
  bool other_streams = false; // recordStream named a stream other than `stream`
  std::shared_ptr<c10::GatheredContext> context; // torch's context when allocated (history)
};

// An allocation torch freed whose memory the library may not hand out yet (see History).
struct Awaiting {
  Alloc a;
  uint64_t seq = 0; // order of the frees: those before a stats reading are covered by it
};

// The newest entries, at most `max` (native's RingBuffer): oldest first once read.
template <typename T>
struct Ring {
  std::vector<T> items;
  size_t next = 0; // the oldest, once full

  // Adds `item`; the one it replaces, if the ring is full, goes to `evicted` (to be
  // destroyed by the caller outside its lock: a context may take the GIL to go).
  void push(T item, size_t max, std::optional<T>& evicted) {
    if (items.size() < max) {
      items.push_back(std::move(item));
      return;
    }
    evicted.emplace(std::move(items[next]));
    items[next] = std::move(item);
    next = (next + 1) % items.size();
  }

  std::vector<T> in_order() const {
    std::vector<T> out;
    out.reserve(items.size());
    out.insert(out.end(), items.begin() + static_cast<ptrdiff_t>(next), items.end());
    out.insert(out.end(), items.begin(), items.begin() + static_cast<ptrdiff_t>(next));
    return out;
  }

  // Keeps the newest `max`; the others go to `dropped`.
  void trim(size_t max, std::vector<T>& dropped) {
    if (items.size() <= max && next == 0) {
      return;
    }
    std::vector<T> all = in_order();
    items.clear();
    next = 0;
    size_t cut = all.size() > max ? all.size() - max : 0;
    for (size_t i = 0; i < all.size(); i++) {
      (i < cut ? dropped : items).push_back(std::move(all[i]));
    }
  }

  void clear(std::vector<T>& dropped) {
    for (auto& item : items) {
      dropped.push_back(std::move(item));
    }
    items.clear();
    next = 0;
  }
};

// One block of a snapshot: an allocation torch holds, or freed and not yet completed.
struct Piece {
  uintptr_t addr = 0;
  Alloc a;
  bool allocated = true;
  bool library_memory = true; // made by the library (else by a MemPool's own allocator)
  // The range this block says the device holds: its device allocation, or itself.
  uintptr_t start = 0;
  uintptr_t end = 0;
  uintptr_t reservation = 0; // the address reservation holding it, if that is all known
};

// cuMemGetAddressRange_v2 (CUresult, CUdeviceptr* base, size_t* size, CUdeviceptr ptr).
using AddressRangeFn = int (*)(unsigned long long*, size_t*, unsigned long long);

struct PoolKey {
  c10::DeviceIndex device;
  MempoolId_t id;
  bool operator==(const PoolKey& o) const {
    return device == o.device && id == o.id;
  }
};

struct PoolKeyHash {
  size_t operator()(const PoolKey& k) const noexcept {
    return std::hash<uint64_t>()(k.id.first * 0x9e3779b97f4a7c15ULL ^ k.id.second) ^
        static_cast<size_t>(k.device);
  }
};

// torch's bookkeeping of one private pool.
struct Pool {
  int use_count = 0;
  bool use_on_oom = false;
  bool no_split = false;
  std::shared_ptr<CCA::CUDAAllocator> allocator; // MemPool(allocator): allocations go there
  std::unordered_set<void*> live;
};

using Filter = std::shared_ptr<std::function<bool(cudaStream_t)>>;

// Per-device counts of torch's own allocations (the library counts every face's).
struct Counts {
  c10::CachingAllocator::StatArray allocation;
  c10::CachingAllocator::StatArray allocated_bytes;
  Stat segment;
  // The library's accumulated counters when the accumulated statistics were last reset.
  LibStats base{};
  // Out-of-memory errors raised (torch's num_ooms: the library does not count the memory
  // fraction's refusals as failures).
  int64_t ooms = 0;
};

void deleter(void* ptr);

class Backend;
Backend* g_backend = nullptr;

// A private pool's state for cudagraph trees: the pool's live allocations when taken.
struct PoolState : public CCA::AllocatorState {
  c10::DeviceIndex device;
  MempoolId_t id;
  std::vector<std::pair<void*, Alloc>> allocs;
  ~PoolState() override;
};

bool call_filter(void* context, cudaStream_t stream) {
  try {
    return (**static_cast<Filter*>(context))(stream);
  } catch (...) {
    return false;
  }
}

void drop_filter(void* context) {
  delete static_cast<Filter*>(context);
}

bool never(void*, cudaStream_t) {
  return false;
}

bool this_thread(void* context, cudaStream_t) {
  return *static_cast<std::thread::id*>(context) == std::this_thread::get_id();
}

void drop_thread(void* context) {
  delete static_cast<std::thread::id*>(context);
}

class Backend : public CCA::CUDAAllocator {
 public:
  explicit Backend(Lib lib) : lib_(lib) {}

  // --- the library ---

  std::string last_error() const {
    const char* e = lib_.last_error();
    return e != nullptr && *e != '\0' ? std::string(e) : std::string("(no message)");
  }

  void check(int status, const char* what) const {
    TORCH_CHECK(status == OK, "streamalloc: ", what, " failed: ", last_error());
  }

  // --- allocation ---

  c10::DataPtr allocate(size_t size) override {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    void* p = size == 0 ? nullptr : malloc(size, device, stream);
    return {p, p, &deleter, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &deleter;
  }

  void* raw_alloc(size_t nbytes) override {
    if (nbytes == 0) {
      return nullptr;
    }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) {
      return nullptr;
    }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc(nbytes, device, stream);
  }

  void raw_delete(void* ptr) override {
    free(ptr);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const final {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // The private pool whose filter takes an allocation on `stream` (newest first, as the
  // library decides), if one is active on `device`.
  bool route(c10::DeviceIndex device, cudaStream_t stream, MempoolId_t& id) {
    if (active_count_[device].load(std::memory_order_acquire) == 0) {
      return false;
    }
    std::vector<std::pair<MempoolId_t, Filter>> active;
    {
      std::lock_guard<std::mutex> lock(mu_);
      active = active_[device];
    }
    for (auto it = active.rbegin(); it != active.rend(); ++it) {
      if ((*it->second)(stream)) {
        id = it->first;
        return true;
      }
    }
    return false;
  }

  void* malloc(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    check_device(device);
    Alloc a;
    a.size = size;
    a.device = device;
    a.stream = stream;
    a.in_pool = route(device, stream, a.pool);
    // Outside every lock: torch's recorder takes the GIL.
    a.context = gather(CCA::RecordContext::STATE);
    void* p = nullptr;
    if (a.in_pool) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pools_.find(PoolKey{device, a.pool});
      if (it != pools_.end()) {
        a.pool_allocator = it->second.allocator;
      }
    }
    if (a.pool_allocator) {
      // torch.cuda.MemPool(allocator): the pool's own allocator serves it (it throws itself).
      p = a.pool_allocator->raw_alloc_with_stream(size, stream);
    } else {
      int status = lib_.allocate(size, device, stream, &p);
      if (status != OK) {
        std::string message = last_error();
        bool oom = status == OUT_OF_MEMORY || status == LIMIT_EXCEEDED;
        if (oom && !a.in_pool && try_oom_pools(size, device, stream, a, p)) {
          status = OK;
        }
        if (status != OK) {
          if (oom) {
            out_of_memory(size, device, stream, message, a.context);
          }
          TORCH_CHECK(false, "streamalloc: allocating ", size, " bytes on device ", static_cast<int>(device),
                      " failed: ", message);
        }
      }
    }
    note_alloc(p, a);
    return p;
  }

  // Pools made with use_on_oom=True take an allocation the device could not serve.
  bool try_oom_pools(size_t size, c10::DeviceIndex device, cudaStream_t stream, Alloc& a, void*& p) {
    std::vector<MempoolId_t> ids;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [key, pool] : pools_) {
        if (key.device == device && pool.use_on_oom && pool.use_count > 0 && !pool.allocator) {
          ids.push_back(key.id);
        }
      }
    }
    std::lock_guard<std::mutex> pools_lock(pool_mu_);
    for (const auto& id : ids) {
      auto* me = new std::thread::id(std::this_thread::get_id());
      if (lib_.pool_begin(device, id.first, id.second, &this_thread, me, &drop_thread) != OK) {
        continue;
      }
      int status = lib_.allocate(size, device, stream, &p);
      lib_.pool_end(device, id.first, id.second);
      lib_.pool_release(device, id.first, id.second);
      if (status == OK) {
        a.in_pool = true;
        a.pool = id;
        return true;
      }
    }
    return false;
  }

  [[noreturn]] void out_of_memory(
      size_t size,
      c10::DeviceIndex device,
      cudaStream_t stream,
      const std::string& message,
      std::shared_ptr<c10::GatheredContext> context) {
    LibStats s{};
    lib_.stats(device, &s);
    size_t device_free = 0;
    size_t device_total = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) {
        (void)cudaGetLastError();
      }
    }
    std::vector<CCA::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      observers = oom_observers_;
      counts_[device].ooms++;
    }
    record(CCA::TraceEntry::OOM, device, device_free, size, stream, {0, 0}, std::move(context));
    for (const auto& observer : observers) {
      observer(device, s.allocated, device_total, device_free);
    }
    c10::reportOutOfMemoryToProfiler(
        static_cast<int64_t>(size), s.allocated, s.reserved, c10::Device(c10::DeviceType::CUDA, device));
    TORCH_CHECK_WITH(
        OutOfMemoryError,
        false,
        "CUDA out of memory (streamalloc). Tried to allocate ",
        size_text(size),
        " on device ",
        static_cast<int>(device),
        ": ",
        message,
        "\nstreamalloc holds ",
        size_text(s.reserved),
        " (",
        size_text(s.allocated),
        " allocated); the device has ",
        size_text(device_free),
        " free of ",
        size_text(device_total),
        ".");
  }

  void note_alloc(void* p, const Alloc& a) {
    if (p == nullptr) {
      return;
    }
    poll_awaiting(a.device);
    std::vector<std::pair<uintptr_t, Alloc>> reused;
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_[p] = a;
      if (a.in_pool) {
        pools_[PoolKey{a.device, a.pool}].live.insert(p);
      }
      count(a, +1);
      if (awaiting_count_[a.device].load(std::memory_order_relaxed) > 0) {
        take_overlapping(a.device, reinterpret_cast<uintptr_t>(p), a.size, reused);
      }
    }
    // Memory the library handed out again: those frees completed before.
    for (auto& [addr, old] : reused) {
      record(CCA::TraceEntry::FREE_COMPLETED, old.device, addr, old.size, old.stream, old.pool, old.context);
    }
    record(CCA::TraceEntry::ALLOC, a.device, reinterpret_cast<size_t>(p), a.size, a.stream, a.pool, a.context);
  }

  // Moves the awaiting frees of `device` that overlap [addr, addr + size) to `out`; mu_ held.
  void take_overlapping(c10::DeviceIndex device, uintptr_t addr, size_t size, std::vector<std::pair<uintptr_t, Alloc>>& out) {
    auto& awaiting = awaiting_[device];
    auto it = awaiting.lower_bound(addr);
    if (it != awaiting.begin()) {
      auto before = std::prev(it);
      if (before->first + before->second.a.size > addr) {
        it = before;
      }
    }
    while (it != awaiting.end() && it->first < addr + size) {
      out.emplace_back(it->first, std::move(it->second.a));
      it = awaiting.erase(it);
    }
    awaiting_count_[device].store(awaiting.size(), std::memory_order_relaxed);
  }

  // Records the completion of the awaiting frees of `device` once the library reports none
  // of its memory pending.
  void poll_awaiting(c10::DeviceIndex device) {
    if (awaiting_count_[device].load(std::memory_order_relaxed) == 0) {
      return;
    }
    // Frees handed to the library before the reading are covered by it.
    uint64_t limit = awaiting_seq_.load(std::memory_order_acquire);
    LibStats s{};
    if (lib_.stats(device, &s) != OK || s.pending_release != 0) {
      return;
    }
    std::vector<std::pair<uintptr_t, Alloc>> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& awaiting = awaiting_[device];
      for (auto it = awaiting.begin(); it != awaiting.end();) {
        if (it->second.seq < limit) {
          done.emplace_back(it->first, std::move(it->second.a));
          it = awaiting.erase(it);
        } else {
          ++it;
        }
      }
      awaiting_count_[device].store(awaiting.size(), std::memory_order_relaxed);
    }
    for (auto& [addr, a] : done) {
      record(CCA::TraceEntry::FREE_COMPLETED, a.device, addr, a.size, a.stream, a.pool, a.context);
    }
  }

  // Adds (+1) or removes (-1) `a` from the counts; mu_ held.
  void count(const Alloc& a, int sign) {
    Counts& c = counts_[a.device];
    auto kind = static_cast<size_t>(a.size <= kSmallSize ? StatType::SMALL_POOL : StatType::LARGE_POOL);
    for (size_t k : {static_cast<size_t>(StatType::AGGREGATE), kind}) {
      if (sign > 0) {
        c.allocation[k].increase(1);
        c.allocated_bytes[k].increase(a.size);
      } else {
        c.allocation[k].decrease(1);
        c.allocated_bytes[k].decrease(a.size);
      }
    }
  }

  void free(void* ptr) {
    if (ptr == nullptr) {
      return;
    }
    // Outside every lock: torch's recorder takes the GIL.
    std::shared_ptr<c10::GatheredContext> context = gather(CCA::RecordContext::ALL);
    Alloc a;
    bool pinned = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(ptr);
      if (it == live_.end()) {
        // Not made through this backend (nothing else hands torch streamalloc memory): let the
        // library judge it.
        // (A deleter must not throw: the reason goes to stderr.)
        if (lib_.deallocate(ptr) != OK) {
          std::fprintf(stderr, "streamalloc: freeing %p: %s\n", ptr, last_error().c_str());
        }
        return;
      }
      a = std::move(it->second);
      live_.erase(it);
      count(a, -1);
      if (a.in_pool) {
        forget_in_pool(ptr, a);
      }
      auto pin = pins_.find(ptr);
      if (pin != pins_.end() && pin->second > 0) {
        pinned = true;
        parked_[ptr] = a;
      }
    }
    record(
        CCA::TraceEntry::FREE_REQUESTED,
        a.device,
        reinterpret_cast<size_t>(ptr),
        a.size,
        a.stream,
        a.pool,
        context ? context : a.context);
    if (!pinned) {
      release_memory(ptr, a, context);
    }
  }

  // mu_ held.
  void forget_in_pool(void* ptr, const Alloc& a) {
    auto pool = pools_.find(PoolKey{a.device, a.pool});
    if (pool != pools_.end()) {
      pool->second.live.erase(ptr);
      if (pool->second.use_count <= 0 && pool->second.live.empty()) {
        pools_.erase(pool);
      }
    }
  }

  void release_memory(void* ptr, const Alloc& a, std::shared_ptr<c10::GatheredContext> context = nullptr) {
    if (a.pool_allocator) {
      a.pool_allocator->raw_delete(ptr);
    } else {
      lib_.free(ptr, static_cast<ssize_t>(a.size), a.device, a.stream);
      if (a.other_streams && recording_.load(std::memory_order_acquire)) {
        // Its reuse waits for the other streams' work (see History; tracked while history
        // is recorded).
        {
          std::lock_guard<std::mutex> lock(mu_);
          Awaiting& w = awaiting_[a.device][reinterpret_cast<uintptr_t>(ptr)];
          w.a = a;
          if (context) {
            w.a.context = context;
          }
          w.seq = awaiting_seq_.fetch_add(1, std::memory_order_acq_rel);
          awaiting_count_[a.device].store(awaiting_[a.device].size(), std::memory_order_relaxed);
        }
        poll_awaiting(a.device);
        return;
      }
    }
    record(
        CCA::TraceEntry::FREE_COMPLETED,
        a.device,
        reinterpret_cast<size_t>(ptr),
        a.size,
        a.stream,
        a.pool,
        context ? context : a.context);
  }

  // --- setup ---

  void init(int device_count) override {
    device_count_ = device_count;
    lib_.init(device_count);
    initialized_ = true;
  }

  bool initialized() override {
    return initialized_;
  }

  void enable(bool value) override {
    enabled_ = value;
  }

  bool isEnabled() const override {
    return enabled_;
  }

  std::string name() override {
    return "streamalloc";
  }

  // --- cache, fraction ---

  void emptyCache(MempoolId_t mempool_id) override {
    // A private pool's memory returns to the device by itself once torch released the pool
    // and its allocations are freed; there is no cache of one pool to empty.
    if (mempool_id.first == 0 && mempool_id.second == 0) {
      lib_.empty_cache();
    }
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = fractions_.find(device);
    return it == fractions_.end() ? 1.0 : it->second;
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check(lib_.set_memory_fraction(device, fraction), "set_per_process_memory_fraction");
    std::lock_guard<std::mutex> lock(mu_);
    fractions_[device] = fraction;
  }

  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    if (*largestBlock == 0) {
      // As native: the free device memory is the first guess of what can be had.
      size_t total = 0;
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaMemGetInfo(largestBlock, &total));
    }
    LibStats s{};
    check(lib_.stats(device, &s), "cacheInfo");
    *largestBlock = std::max(*largestBlock, s.largest_free_block);
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    return lib_.base_allocation(ptr, size);
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // As native: storages sent to another process carry torch's IPC deleter, which keeps the
    // original (and its streams) itself.
    if (ptr.get_deleter() != &deleter || ptr.get() == nullptr) {
      return;
    }
    std::shared_ptr<CCA::CUDAAllocator> pool_allocator;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(ptr.get());
      if (it != live_.end()) {
        pool_allocator = it->second.pool_allocator;
        if (stream.stream() != it->second.stream) {
          it->second.other_streams = true;
        }
      }
    }
    if (pool_allocator) { // memory of a MemPool's own allocator: its record_stream
      pool_allocator->recordStream(ptr, stream);
      return;
    }
    check(lib_.record_stream(ptr.get(), stream.stream()), "record_stream");
  }

  // --- statistics ---

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device(device);
    LibStats s{};
    check(lib_.stats(device, &s), "memory_stats");
    std::lock_guard<std::mutex> lock(mu_);
    Counts& c = counts_[device];
    const LibStats& b = c.base;
    DeviceStats d;
    const auto all = static_cast<size_t>(StatType::AGGREGATE);
    const auto large = static_cast<size_t>(StatType::LARGE_POOL);
    // Allocations and their bytes, current, peak and accumulated: the backend's count of torch's
    // tensors, as torch's own allocators count them (down at torch's free, also when the memory
    // waits for a recorded stream or is held for a cudagraph trees checkpoint). Not the
    // library's allocated_peak: under a stream-ordered strategy that adds up the peaks of each
    // stream's pool, which overstates the peak of all of them together.
    d.allocation = c.allocation;
    d.active = c.allocation;
    d.allocated_bytes = c.allocated_bytes;
    d.active_bytes = d.allocated_bytes;
    d.requested_bytes = d.allocated_bytes; // the library counts sizes as asked for
    for (size_t k : {all, large}) { // reserved memory is not split by request size
      d.reserved_bytes[k].current = static_cast<int64_t>(s.reserved);
      d.reserved_bytes[k].peak = static_cast<int64_t>(s.reserved_peak);
    }
    d.inactive_split_bytes[all].current = static_cast<int64_t>(s.cached);
    int64_t segments = static_cast<int64_t>(s.device_allocs) - static_cast<int64_t>(s.device_frees);
    c.segment.current = std::max<int64_t>(segments, 0);
    c.segment.peak = std::max(c.segment.peak, c.segment.current);
    for (size_t k : {all, large}) {
      d.segment[k].current = c.segment.current;
      d.segment[k].peak = c.segment.peak;
      d.segment[k].allocated = static_cast<int64_t>(s.device_allocs - b.device_allocs);
      d.segment[k].freed = static_cast<int64_t>(s.device_frees - b.device_frees);
    }
    d.num_alloc_retries = static_cast<int64_t>(s.retries - b.retries);
    d.num_ooms = c.ooms;
    d.num_device_alloc = static_cast<int64_t>(s.device_allocs - b.device_allocs);
    d.num_device_free = static_cast<int64_t>(s.device_frees - b.device_frees);
    d.num_sync_all_streams = 0;
    d.max_split_size = 0;
    return d;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device(device);
    LibStats s{};
    check(lib_.stats(device, &s), "reset_accumulated_memory_stats");
    std::lock_guard<std::mutex> lock(mu_);
    Counts& c = counts_[device];
    for (auto& stat : c.allocation) {
      stat.reset_accumulated();
    }
    for (auto& stat : c.allocated_bytes) {
      stat.reset_accumulated();
    }
    c.segment.reset_accumulated();
    c.ooms = 0;
    c.base = s;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_device(device);
    check(lib_.reset_peak_stats(device), "reset_peak_memory_stats");
    std::lock_guard<std::mutex> lock(mu_);
    Counts& c = counts_[device];
    for (auto& stat : c.allocation) {
      stat.reset_peak();
    }
    for (auto& stat : c.allocated_bytes) {
      stat.reset_peak();
    }
    c.segment.reset_peak();
  }

  // See History at the top of the file.
  CCA::SnapshotInfo snapshot(MempoolId_t mempool_id, bool include_traces) override {
    CCA::SnapshotInfo info;
    auto& md = info.config_metadata;
    md.garbage_collection_threshold = 0.0;
    md.max_split_size = std::numeric_limits<size_t>::max(); // native's "no limit"
    md.pinned_num_register_threads = 1;
    md.expandable_segments = false;
    md.release_lock_on_malloc = false;
    md.pinned_use_host_register = false;
    md.graph_capture_record_stream_reuse = false;
    md.last_allocator_settings = "";
    bool all_pools = mempool_id.first == 0 && mempool_id.second == 0;
    for (c10::DeviceIndex d = 0; d < kMaxDevices; d++) {
      poll_awaiting(d);
    }

    // What torch holds, and what it freed that the library may not hand out yet.
    std::vector<Piece> pieces;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // `held`: the library still holds it for torch (live, or kept for a checkpoint), so
      // it may be asked about it.
      auto add = [&](uintptr_t addr, const Alloc& a, bool allocated, bool held) {
        if (!all_pools && !(a.in_pool && a.pool == mempool_id)) {
          return;
        }
        Piece piece;
        piece.addr = addr;
        piece.a = a;
        piece.allocated = allocated;
        piece.library_memory = held && !a.pool_allocator;
        pieces.push_back(std::move(piece));
      };
      for (const auto& [p, a] : live_) {
        add(reinterpret_cast<uintptr_t>(p), a, true, true);
      }
      for (const auto& [p, a] : parked_) {
        add(reinterpret_cast<uintptr_t>(p), a, false, true);
      }
      for (const auto& awaiting : awaiting_) {
        for (const auto& [addr, w] : awaiting) {
          add(addr, w.a, false, false);
        }
      }
    }
    std::sort(pieces.begin(), pieces.end(), [](const Piece& x, const Piece& y) {
      return x.a.device != y.a.device ? x.a.device < y.a.device : x.addr < y.addr;
    });
    int devices = std::max(device_count_, 0);
    std::vector<size_t> active_bytes(kMaxDevices, 0);
    for (size_t i = 0; i < pieces.size();) {
      size_t j = i;
      while (j < pieces.size() && pieces[j].a.device == pieces[i].a.device) {
        j++;
      }
      c10::DeviceIndex device = pieces[i].a.device;
      devices = std::max(devices, static_cast<int>(device) + 1);
      describe_device(device, pieces.data() + i, pieces.data() + j, info.segments, active_bytes[device]);
      i = j;
    }
    devices = std::min(devices, kMaxDevices);
    if (all_pools) {
      // The library's other reserved bytes: where, not known here.
      for (int d = 0; d < devices; d++) {
        LibStats s{};
        if (lib_.stats(d, &s) != OK) {
          continue;
        }
        size_t known = 0;
        for (const auto& seg : info.segments) {
          if (seg.device == d) {
            known += seg.total_size;
          }
        }
        if (s.reserved > known) {
          c10::CachingDeviceAllocator::SegmentInfo seg;
          seg.device = static_cast<c10::DeviceIndex>(d);
          seg.address = 0;
          seg.total_size = s.reserved - known;
          seg.is_large = true;
          c10::CachingDeviceAllocator::BlockInfo block;
          block.size = seg.total_size;
          seg.blocks.push_back(block);
          info.segments.push_back(std::move(seg));
        }
      }
    }

    info.device_traces.resize(static_cast<size_t>(devices));
    if (include_traces) {
      std::lock_guard<std::mutex> lock(hist_mu_);
      auto to_ns = clock_.makeConverter();
      for (int d = 0; d < devices; d++) {
        auto& out = info.device_traces[static_cast<size_t>(d)];
        out = rings_[d].in_order();
        for (auto& entry : out) {
          entry.time_.t_ = to_ns(entry.time_.approx_t_) / 1000;
        }
      }
      info.external_annotations = annotations_.in_order();
      for (auto& entry : info.external_annotations) {
        entry.time_.t_ = to_ns(entry.time_.approx_t_) / 1000;
      }
    }
    if (recording_.load(std::memory_order_acquire)) {
      for (int d = 0; d < devices; d++) {
        record(CCA::TraceEntry::SNAPSHOT, static_cast<c10::DeviceIndex>(d), 0, active_bytes[d], nullptr, mempool_id, nullptr);
      }
    }
    return info;
  }

  // The driver's range of the device allocation holding `ptr` (cuMemGetAddressRange, current
  // device's context): the driver's own function when found, else the library's (which
  // reports a failure on stderr, so it is asked only about the library's live memory).
  bool device_range(uintptr_t ptr, bool library_memory, uintptr_t& base, size_t& len) {
    std::call_once(driver_once_, [this] {
      void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
      if (driver != nullptr) {
        address_range_ = reinterpret_cast<AddressRangeFn>(dlsym(driver, "cuMemGetAddressRange_v2"));
      }
    });
    if (address_range_ != nullptr) {
      unsigned long long b = 0;
      size_t n = 0;
      if (address_range_(&b, &n, static_cast<unsigned long long>(ptr)) == 0 && n > 0) {
        base = static_cast<uintptr_t>(b);
        len = n;
        return true;
      }
      return false;
    }
    if (!library_memory) {
      return false;
    }
    size_t n = 0;
    void* b = lib_.base_allocation(reinterpret_cast<void*>(ptr), &n);
    if (n == 0) {
      return false;
    }
    base = reinterpret_cast<uintptr_t>(b);
    len = n;
    return true;
  }

  // The segments of one device's pieces [first, last), sorted by address (see History).
  void describe_device(
      c10::DeviceIndex device,
      Piece* first,
      Piece* last,
      std::vector<c10::CachingDeviceAllocator::SegmentInfo>& segments,
      size_t& active_bytes) {
    LibStats s{};
    bool have_stats = lib_.stats(device, &s) == OK;
    {
      c10::cuda::CUDAGuard guard(device);
      uintptr_t known_base = 0;
      size_t known_len = 0;
      for (Piece* p = first; p != last; ++p) {
        uintptr_t end = p->addr + p->a.size;
        uintptr_t base = 0;
        size_t len = 0;
        bool found = false;
        if (known_len > 0 && p->addr >= known_base && end <= known_base + known_len) {
          base = known_base;
          len = known_len;
          found = true;
        } else if (device_range(p->addr, p->library_memory, base, len)) {
          known_base = base;
          known_len = len;
          found = true;
        }
        p->start = p->addr;
        p->end = end;
        if (found && base <= p->addr && end <= base + len) {
          if (!have_stats || len <= s.reserved) {
            p->start = base;
            p->end = base + len;
          } else {
            p->reservation = base; // more than the library holds: an address reservation
          }
        }
      }
    }
    // Ranges that overlap, and blocks of one reservation, make one segment.
    std::vector<Piece*> order;
    for (Piece* p = first; p != last; ++p) {
      order.push_back(p);
    }
    std::sort(order.begin(), order.end(), [](const Piece* x, const Piece* y) {
      return x->start != y->start ? x->start < y->start : x->addr < y->addr;
    });
    std::vector<std::vector<Piece*>> groups;
    uintptr_t start = 0;
    uintptr_t end = 0;
    uintptr_t reservation = 0;
    std::vector<std::pair<uintptr_t, uintptr_t>> bounds;
    for (Piece* p : order) {
      bool joins = !groups.empty() &&
          (p->start < end || (p->reservation != 0 && p->reservation == reservation));
      if (joins) {
        end = std::max(end, p->end);
        reservation = reservation != 0 ? reservation : p->reservation;
        groups.back().push_back(p);
        bounds.back().second = end;
      } else {
        start = p->start;
        end = p->end;
        reservation = p->reservation;
        groups.push_back({p});
        bounds.emplace_back(start, end);
      }
    }
    for (size_t g = 0; g < groups.size(); g++) {
      auto& members = groups[g];
      std::sort(members.begin(), members.end(), [](const Piece* x, const Piece* y) { return x->addr < y->addr; });
      c10::CachingDeviceAllocator::SegmentInfo seg;
      seg.device = device;
      seg.address = bounds[g].first;
      seg.total_size = bounds[g].second - bounds[g].first;
      seg.stream = members.front()->a.stream;
      seg.owner_private_pool_id = members.front()->a.in_pool ? members.front()->a.pool : MempoolId_t{0, 0};
      uintptr_t cursor = bounds[g].first;
      for (Piece* p : members) {
        if (p->addr < cursor) {
          continue; // overlaps the block before (cannot happen): not drawn twice
        }
        if (p->addr > cursor) {
          c10::CachingDeviceAllocator::BlockInfo gap;
          gap.size = p->addr - cursor;
          seg.blocks.push_back(gap);
        }
        c10::CachingDeviceAllocator::BlockInfo block;
        block.size = p->a.size;
        block.requested_size = p->a.size;
        block.allocated = p->allocated;
        block.active = true;
        block.context_when_allocated = p->a.context;
        seg.blocks.push_back(block);
        seg.active_size += p->a.size;
        if (p->allocated) {
          seg.allocated_size += p->a.size;
          seg.requested_size += p->a.size;
          active_bytes += p->a.size;
        }
        seg.is_large = seg.is_large || p->a.size > kSmallSize;
        seg.is_expandable = seg.is_expandable || p->reservation != 0;
        cursor = p->addr + p->a.size;
      }
      if (cursor < bounds[g].second) {
        c10::CachingDeviceAllocator::BlockInfo gap;
        gap.size = bounds[g].second - cursor;
        seg.blocks.push_back(gap);
      }
      segments.push_back(std::move(seg));
    }
  }

  // --- private pools (CUDA graphs, torch.cuda.MemPool, use_mem_pool) ---

  void beginAllocateToPool(
      c10::DeviceIndex device,
      MempoolId_t mempool_id,
      std::function<bool(cudaStream_t)> filter) override {
    check_device(device);
    auto shared = std::make_shared<std::function<bool(cudaStream_t)>>(std::move(filter));
    std::lock_guard<std::mutex> pools_lock(pool_mu_);
    bool own_allocator;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Pool& pool = pools_[PoolKey{device, mempool_id}];
      own_allocator = static_cast<bool>(pool.allocator);
      pool.use_count += 1;
      active_[device].emplace_back(mempool_id, shared);
      active_count_[device].store(active_[device].size(), std::memory_order_release);
    }
    if (!own_allocator) {
      auto* context = new Filter(shared);
      int status = lib_.pool_begin(device, mempool_id.first, mempool_id.second, &call_filter, context, &drop_filter);
      if (status != OK) {
        std::string message = last_error();
        undo_begin(device, mempool_id);
        TORCH_CHECK(false, "streamalloc: beginAllocateToPool failed: ", message);
      }
    }
  }

  // Removes the newest active filter of `id` on `device`; mu_ held.
  void remove_active(c10::DeviceIndex device, MempoolId_t id) {
    auto& active = active_[device];
    for (auto it = active.rbegin(); it != active.rend(); ++it) {
      if (it->first == id) {
        active.erase(std::next(it).base());
        break;
      }
    }
    active_count_[device].store(active.size(), std::memory_order_release);
  }

  // Undoes a beginAllocateToPool the library refused: its filter, and the pool's use; mu_
  // not held.
  void undo_begin(c10::DeviceIndex device, MempoolId_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    remove_active(device, id);
    auto pool = pools_.find(PoolKey{device, id});
    if (pool != pools_.end()) {
      pool->second.use_count -= 1;
    }
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    check_device(device);
    std::lock_guard<std::mutex> pools_lock(pool_mu_);
    bool own_allocator = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      remove_active(device, mempool_id);
      auto pool = pools_.find(PoolKey{device, mempool_id});
      own_allocator = pool != pools_.end() && pool->second.allocator;
    }
    if (!own_allocator) {
      check(lib_.pool_end(device, mempool_id.first, mempool_id.second), "endAllocateToPool");
    }
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    check_device(device);
    std::lock_guard<std::mutex> pools_lock(pool_mu_);
    bool own_allocator = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto pool = pools_.find(PoolKey{device, mempool_id});
      if (pool == pools_.end()) {
        return;
      }
      own_allocator = static_cast<bool>(pool->second.allocator);
      pool->second.use_count = std::max(pool->second.use_count - 1, 0);
      if (pool->second.use_count == 0 && pool->second.live.empty()) {
        pools_.erase(pool);
      }
    }
    if (!own_allocator) {
      check(lib_.pool_release(device, mempool_id.first, mempool_id.second), "releasePool");
    }
  }

  void createOrIncrefPool(
      c10::DeviceIndex device,
      MempoolId_t mempool_id,
      std::shared_ptr<CCA::CUDAAllocator> allocator) override {
    check_device(device);
    std::lock_guard<std::mutex> pools_lock(pool_mu_);
    bool own_allocator;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto [it, made] = pools_.try_emplace(PoolKey{device, mempool_id});
      Pool& pool = it->second;
      TORCH_CHECK(
          made || allocator == nullptr || allocator == pool.allocator,
          "streamalloc: pool (",
          mempool_id.first,
          ", ",
          mempool_id.second,
          ") exists with another allocator");
      if (made) {
        pool.allocator = std::move(allocator);
      }
      own_allocator = static_cast<bool>(pool.allocator);
      pool.use_count += 1;
    }
    if (!own_allocator) {
      // The library's pools gain a use with each begin: a begin that matches nothing, ended
      // at once (no other begin of this pool can come between: pool_mu_ is held).
      int status = lib_.pool_begin(device, mempool_id.first, mempool_id.second, &never, nullptr, nullptr);
      if (status == OK) {
        status = lib_.pool_end(device, mempool_id.first, mempool_id.second);
      }
      if (status != OK) {
        std::string message = last_error();
        std::lock_guard<std::mutex> lock(mu_);
        pools_[PoolKey{device, mempool_id}].use_count -= 1;
        TORCH_CHECK(false, "streamalloc: createOrIncrefPool failed: ", message);
      }
    }
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto pool = pools_.find(PoolKey{device, mempool_id});
    return pool == pools_.end() ? 0 : pool->second.use_count;
  }

  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto pool = pools_.find(PoolKey{device, mempool_id});
    if (pool != pools_.end()) {
      pool->second.use_on_oom = use_on_oom;
    }
  }

  void setNoSplit(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    // A private pool's blocks are split by the library as it sees fit; the flag is kept so
    // that it reads back, and has no other effect.
    std::lock_guard<std::mutex> lock(mu_);
    auto pool = pools_.find(PoolKey{device, mempool_id});
    if (pool != pools_.end()) {
      pool->second.no_split = true;
    }
  }

  bool checkPoolLiveAllocations(
      c10::DeviceIndex device,
      MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto pool = pools_.find(PoolKey{device, mempool_id});
    if (pool == pools_.end()) {
      return expected_live_allocations.empty();
    }
    return pool->second.live == expected_live_allocations;
  }

  // --- cudagraph trees' checkpoints ---

  std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex device, MempoolId_t id) override {
    auto state = std::make_shared<PoolState>();
    state->device = device;
    state->id = id;
    std::lock_guard<std::mutex> lock(mu_);
    auto pool = pools_.find(PoolKey{device, id});
    if (pool != pools_.end()) {
      for (void* p : pool->second.live) {
        state->allocs.emplace_back(p, live_.at(p));
        pins_[p] += 1;
      }
    }
    return state;
  }

  CCA::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<CCA::AllocatorState> as) override {
    auto state = std::dynamic_pointer_cast<PoolState>(as);
    TORCH_CHECK(state, "streamalloc: setCheckpointPoolState was given another allocator's state");
    TORCH_CHECK(state->device == device, "streamalloc: checkpoint of device ", static_cast<int>(state->device),
                " set on ", static_cast<int>(device));
    CCA::CheckpointDelta delta;
    std::vector<std::pair<void*, Alloc>> to_release;
    // History entries, recorded once mu_ is released: (action, address, allocation).
    std::vector<std::tuple<CCA::TraceEntry::Action, void*, Alloc>> events;
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::unordered_set<void*> wanted;
      for (const auto& entry : state->allocs) {
        wanted.insert(entry.first);
      }
      // Everything live in the pool now is freed (as native does); what the checkpoint wants
      // keeps its memory, which is then handed out again below.
      auto pool = pools_.find(PoolKey{device, state->id});
      std::vector<void*> now;
      if (pool != pools_.end()) {
        now.assign(pool->second.live.begin(), pool->second.live.end());
      }
      for (void* p : now) {
        Alloc a = live_.at(p);
        live_.erase(p);
        count(a, -1);
        pools_[PoolKey{device, state->id}].live.erase(p);
        delta.ptrs_freed.push_back(p);
        events.emplace_back(CCA::TraceEntry::FREE_REQUESTED, p, a);
        if (wanted.count(p)) {
          // Handed back below at once.
          events.emplace_back(CCA::TraceEntry::FREE_COMPLETED, p, a);
          continue;
        }
        auto pin = pins_.find(p);
        if (pin != pins_.end() && pin->second > 0) {
          parked_[p] = a;
        } else {
          to_release.emplace_back(p, a);
        }
      }
      for (const auto& [p, recorded] : state->allocs) {
        auto parked = parked_.find(p);
        if (parked != parked_.end()) {
          events.emplace_back(CCA::TraceEntry::FREE_COMPLETED, p, parked->second);
          parked_.erase(parked);
        } else {
          TORCH_INTERNAL_ASSERT(
              std::find(now.begin(), now.end(), p) != now.end(),
              "streamalloc: a checkpointed allocation was neither live nor held");
        }
        live_[p] = recorded;
        count(recorded, +1);
        pools_[PoolKey{device, state->id}].live.insert(p);
        delta.dataptrs_allocd.emplace_back(p, p, &deleter, c10::Device(c10::DeviceType::CUDA, device));
        events.emplace_back(CCA::TraceEntry::ALLOC, p, recorded);
      }
    }
    for (const auto& [action, p, a] : events) {
      record(action, a.device, reinterpret_cast<size_t>(p), a.size, a.stream, a.pool, a.context);
    }
    for (const auto& [p, a] : to_release) {
      release_memory(p, a);
    }
    return delta;
  }

  // A checkpoint state is gone: its allocations that torch freed meanwhile go back now.
  void unpin(const std::vector<std::pair<void*, Alloc>>& allocs) {
    std::vector<std::pair<void*, Alloc>> to_release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& entry : allocs) {
        auto pin = pins_.find(entry.first);
        if (pin == pins_.end()) {
          continue;
        }
        if (--pin->second > 0) {
          continue;
        }
        pins_.erase(pin);
        auto parked = parked_.find(entry.first);
        if (parked != parked_.end()) {
          to_release.emplace_back(parked->first, parked->second);
          parked_.erase(parked);
        }
      }
    }
    for (const auto& [p, a] : to_release) {
      release_memory(p, a);
    }
  }

  // --- IPC ---

  static constexpr unsigned char kHandleVersion = 2; // torch <= 2.12's SHAREABLE_HANDLE_VERSION
  static constexpr char kCudaMalloc = 'c'; // SHAREABLE_CUDA_MALLOC
  static constexpr char kMapped = 'e'; // SHAREABLE_CUDA_EXPANDABLE_SEGMENT: streamalloc_ipc_export's

  // Note [IPC formats]: memory of cuMemAlloc chunks travels as torch's 'c' (a CUDA IPC handle
  // of the chunk); mapped memory as torch's 'e' (ExpandableSegment::share's layout:
  // streamalloc_ipc_export writes it, 2 MiB allocations exported as file descriptors, plus a
  // trailer torch's receiver does not read), so a receiver under torch's own allocator opens
  // either. The driver's pool (strategy=async) is refused at put, naming the configs that share.
  CCA::ShareableHandle shareIpcHandle(void* ptr) override {
    size_t size = 0;
    void* base = lib_.base_allocation(ptr, &size);
    cudaIpcMemHandle_t handle;
    cudaError_t err = cudaIpcGetMemHandle(&handle, base);
    if (err == cudaSuccess) {
      std::string s;
      s.push_back(static_cast<char>(kHandleVersion));
      s.push_back(kCudaMalloc);
      s.append(reinterpret_cast<const char*>(&handle), CUDA_IPC_HANDLE_SIZE);
      return CCA::ShareableHandle{static_cast<char*>(ptr) - static_cast<char*>(base), s};
    }
    (void)cudaGetLastError();
    std::string why = std::string("cudaIpcGetMemHandle failed: ") + cudaGetErrorString(err);
    size_t alloc_size = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(ptr);
      if (it != live_.end() && !it->second.pool_allocator) {
        alloc_size = it->second.size;
      }
    }
    if (alloc_size > 0) {
      size_t needed = 0;
      size_t offset = 0;
      if (lib_.ipc_export(ptr, alloc_size, nullptr, 0, &needed, &offset) == OK) {
        std::string s(needed, '\0');
        auto* buf = reinterpret_cast<uint8_t*>(&s[0]);
        if (lib_.ipc_export(ptr, alloc_size, buf, s.size(), &needed, &offset) == OK) {
          return CCA::ShareableHandle{static_cast<ptrdiff_t>(offset), s};
        }
      }
      why = last_error() + " (and " + why + ")";
    } else {
      why += ", and the pointer is no live allocation of streamalloc's";
    }
    TORCH_CHECK(
        false,
        "streamalloc: this CUDA tensor's memory cannot be shared with another process (IPC): ",
        why,
        ". Configurations that share: the default (stitched) and backing=segments (torch's expandable-"
        "segment format: the receiver, under torch's allocator or streamalloc, copies file descriptors "
        "with pidfd_getfd), backing=chunks or strategy=plain (CUDA IPC handles)");
  }

  // As torch's native getIpcDevPtr: one mapping per handle while a tensor holds it, the cache
  // entry erased by the deleter (an entry never erased would keep every handle ever opened).
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    std::lock_guard<std::mutex> lock(ipc_mu_);
    auto found = ipc_.find(handle);
    if (found != ipc_.end()) {
      if (auto sp = found->second.lock()) {
        return sp;
      }
    }
    // A raw handle of an old torch is CUDA_IPC_HANDLE_SIZE bytes; ours and torch's 'e' are not.
    bool mapped = handle.size() != CUDA_IPC_HANDLE_SIZE && handle.size() >= 2 && handle[1] == kMapped;
    void* base = mapped ? open_mapped(handle) : open_cuda_ipc(handle);
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    Lib lib = lib_;
    std::shared_ptr<void> sp(base, [this, lib, handle, mapped, device](void* p) {
      {
        std::lock_guard<std::mutex> erase(ipc_mu_);
        auto it = ipc_.find(handle);
        if (it != ipc_.end() && it->second.expired()) {
          ipc_.erase(it);
        }
      }
      close_ipc(lib, p, mapped, device); // a deleter may not throw: close_ipc reports, never throws
    });
    ipc_[handle] = sp;
    return sp;
  }

  // torch's 'e' (from streamalloc_ipc_export, or torch's own expandable segments): mapped here
  // until the last tensor over it goes. PyTorch's own names no device: the current one.
  void* open_mapped(const std::string& handle) {
    TORCH_CHECK(
        static_cast<unsigned char>(handle[0]) <= kHandleVersion,
        "streamalloc: IPC handle of a newer torch (version ",
        static_cast<int>(static_cast<unsigned char>(handle[0])),
        ")");
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    void* base = nullptr;
    int status = lib_.ipc_open(reinterpret_cast<const uint8_t*>(handle.data()), handle.size(), device, &base);
    TORCH_CHECK(
        status == OK,
        "streamalloc: cannot open a CUDA tensor another process shared (IPC): ",
        last_error());
    return base;
  }

  // torch's 'c': a CUDA IPC handle.
  static void* open_cuda_ipc(const std::string& handle) {
    int type = kCudaMalloc;
    size_t at = 0;
    if (handle.size() != CUDA_IPC_HANDLE_SIZE) { // else a raw handle of an old torch
      TORCH_CHECK(handle.size() >= 2 + CUDA_IPC_HANDLE_SIZE, "streamalloc: ill-formed IPC handle");
      // Unsigned: a byte >= 0x80 is no older version.
      auto version = static_cast<unsigned char>(handle[0]);
      TORCH_CHECK(version <= kHandleVersion, "streamalloc: IPC handle of a newer torch (version ", int(version), ")");
      type = handle[1];
      at = 2;
    }
    TORCH_CHECK(
        type == kCudaMalloc,
        "streamalloc: cannot open this IPC handle (type '",
        static_cast<char>(type),
        "'): neither torch's 'c' (CUDA IPC) nor 'e' (mapped memory); a streamalloc older than the "
        "receiver's made it ('s'), or it is no IPC handle");
    cudaIpcMemHandle_t cuda_handle;
    std::memcpy(&cuda_handle, handle.data() + at, CUDA_IPC_HANDLE_SIZE);
    void* dev = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&dev, cuda_handle, cudaIpcMemLazyEnablePeerAccess));
    return dev;
  }

  // Closes what getIpcDevPtr opened; reports on stderr, never throws (it runs in a deleter).
  // streamalloc_ipc_close waits for the device's work on a thread of the library's, bounded by
  // wait_timeout, and unmaps later past it.
  static void close_ipc(const Lib& lib, void* p, bool mapped, c10::DeviceIndex device) {
    if (mapped) {
      if (lib.ipc_close(p) != OK) {
        const char* e = lib.last_error();
        std::fprintf(stderr, "streamalloc: closing a CUDA tensor of another process (IPC): %s\n", e ? e : "?");
      }
      return;
    }
    try {
      c10::cuda::CUDAGuard guard(device);
      if (cudaIpcCloseMemHandle(p) != cudaSuccess) {
        (void)cudaGetLastError();
      }
    } catch (...) {
      std::fprintf(stderr, "streamalloc: closing a CUDA IPC handle on device %d failed\n", int(device));
    }
  }

  // --- history, observers, trackers ---

  bool isHistoryEnabled() override {
    return recording_.load(std::memory_order_acquire);
  }

  // As native: recording (re)starts with these settings on every device; disabling, or
  // clearHistory, empties the rings; skip_actions (torch's action names) are not kept.
  void recordHistory(
      bool enabled,
      CCA::CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      CCA::RecordContext when,
      bool clearHistory,
      const std::vector<std::string>& skip_actions) override {
    TORCH_CHECK(
        when == CCA::RecordContext::NEVER || context_recorder != nullptr,
        "streamalloc: recordHistory needs a context recorder to record contexts");
    std::set<int> skip;
    for (const auto& name : skip_actions) {
      skip.insert(static_cast<int>(c10::CachingDeviceAllocator::parseTraceEntryAction(name)));
    }
    // Dropped entries go once the lock is released (a context may take the GIL to go).
    std::vector<CCA::TraceEntry> dropped;
    std::vector<c10::CachingDeviceAllocator::AnnotationEntry> dropped_annotations;
    std::map<uintptr_t, Awaiting> dropped_awaiting[kMaxDevices];
    {
      std::lock_guard<std::mutex> lock(hist_mu_);
      recorder_.store(enabled ? context_recorder : nullptr, std::memory_order_release);
      when_.store(enabled ? static_cast<int>(when) : 0, std::memory_order_release);
      max_entries_ = std::max<size_t>(alloc_trace_max_entries, 1);
      skip_ = std::move(skip);
      for (auto& ring : rings_) {
        if (!enabled || clearHistory) {
          ring.clear(dropped);
        } else {
          ring.trim(max_entries_, dropped);
        }
      }
      if (!enabled || clearHistory) {
        annotations_.clear(dropped_annotations);
      } else {
        annotations_.trim(max_entries_, dropped_annotations);
      }
      recording_.store(enabled, std::memory_order_release);
    }
    if (!enabled) {
      // Frees awaiting their completion are tracked only while recording.
      std::lock_guard<std::mutex> lock(mu_);
      for (int d = 0; d < kMaxDevices; d++) {
        dropped_awaiting[d].swap(awaiting_[d]);
        awaiting_count_[d].store(0, std::memory_order_relaxed);
      }
    }
  }

  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    if (!recording_.load(std::memory_order_acquire)) {
      return;
    }
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    c10::CachingDeviceAllocator::AnnotationEntry entry(device, c10::getApproximateTime());
    for (const auto& [name, value] : md) {
      entry.recordUserMetadata(name, value);
    }
    std::optional<c10::CachingDeviceAllocator::AnnotationEntry> evicted;
    std::lock_guard<std::mutex> lock(hist_mu_);
    annotations_.push(std::move(entry), max_entries_, evicted);
  }

  void pushCompileContext(std::string& md) override {
    std::lock_guard<std::mutex> lock(hist_mu_);
    compile_contexts_.push_back(md);
  }

  void popCompileContext() override {
    std::lock_guard<std::mutex> lock(hist_mu_);
    if (!compile_contexts_.empty()) {
      compile_contexts_.pop_back();
    }
  }

  void setUserMetadata(const std::string& metadata) override {
    std::lock_guard<std::mutex> lock(hist_mu_);
    user_metadata_ = metadata;
  }

  std::string getUserMetadata() override {
    std::lock_guard<std::mutex> lock(hist_mu_);
    return user_metadata_;
  }

  // torch's context (stack) if history records contexts at `level`; never call with a lock
  // held (the recorder takes the GIL). Never throws (a deleter calls it).
  std::shared_ptr<c10::GatheredContext> gather(CCA::RecordContext level) {
    if (when_.load(std::memory_order_acquire) < static_cast<int>(level)) {
      return nullptr;
    }
    CCA::CreateContextFn recorder = recorder_.load(std::memory_order_acquire);
    if (recorder == nullptr) {
      return nullptr;
    }
    try {
      return recorder();
    } catch (...) {
      return nullptr;
    }
  }

  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(mu_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override {
    std::lock_guard<std::mutex> lock(hist_mu_);
    auto trackers = std::make_shared<std::vector<CCA::AllocatorTraceTracker>>(
        trackers_ ? *trackers_ : std::vector<CCA::AllocatorTraceTracker>{});
    trackers->push_back(std::move(tracker));
    trackers_ = std::move(trackers);
    have_trackers_.store(true, std::memory_order_release);
  }

  // One event: to torch's trace trackers, and into the device's ring while history is
  // recorded (native's record_trace). The context is kept when `when` is ALLOC or ALL. Call
  // without mu_ held.
  void record(
      CCA::TraceEntry::Action action,
      c10::DeviceIndex device,
      size_t addr,
      size_t size,
      cudaStream_t stream,
      MempoolId_t pool,
      std::shared_ptr<c10::GatheredContext> context) {
    if (!recording_.load(std::memory_order_acquire) && !have_trackers_.load(std::memory_order_acquire)) {
      return;
    }
    if (device < 0 || device >= kMaxDevices) {
      return;
    }
    if (when_.load(std::memory_order_acquire) < static_cast<int>(CCA::RecordContext::ALLOC)) {
      context.reset();
    }
    std::shared_ptr<const std::vector<CCA::AllocatorTraceTracker>> trackers;
    std::optional<CCA::TraceEntry> for_trackers;
    std::optional<CCA::TraceEntry> evicted; // destroyed after the lock is released
    {
      std::lock_guard<std::mutex> lock(hist_mu_);
      // Taken under the lock: a ring's times never go back.
      CCA::TraceEntry entry(
          action,
          device,
          addr,
          size,
          stream,
          pool,
          c10::getApproximateTime(),
          std::move(context),
          compile_contexts_.empty() ? std::string("N/A") : compile_contexts_.back(),
          user_metadata_);
      trackers = trackers_;
      if (trackers && !trackers->empty()) {
        for_trackers.emplace(entry);
      }
      if (recording_.load(std::memory_order_relaxed) && skip_.count(static_cast<int>(action)) == 0) {
        rings_[device].push(std::move(entry), max_entries_, evicted);
      }
    }
    if (for_trackers) {
      for (const auto& tracker : *trackers) {
        tracker(*for_trackers);
      }
    }
  }

  // --- peers, copies ---

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    {
      c10::cuda::CUDAGuard guard(dev);
      cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
      } else {
        C10_CUDA_CHECK(err);
      }
    }
    // `dev` reads and writes the memory streamalloc maps for `dev_to_access`.
    check(lib_.enable_peer_access(dev_to_access, dev), "enablePeerAccess");
  }

  cudaError_t memcpyAsync(
      void* dst,
      int dstDevice,
      const void* src,
      int srcDevice,
      size_t count,
      cudaStream_t stream,
      bool p2p_enabled) override {
    if (p2p_enabled || srcDevice == dstDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    // Mapped memory (expandable=true) needs the peer copy without peer access.
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

 private:
  Lib lib_;
  bool initialized_ = false;
  bool enabled_ = true;
  int device_count_ = 0;

  std::mutex mu_; // the tables below
  std::mutex pool_mu_; // orders the library's pool calls (taken before mu_)
  std::unordered_map<void*, Alloc> live_;
  std::unordered_map<PoolKey, Pool, PoolKeyHash> pools_;
  std::vector<std::pair<MempoolId_t, Filter>> active_[kMaxDevices];
  std::atomic<size_t> active_count_[kMaxDevices] = {};
  Counts counts_[kMaxDevices];
  std::map<c10::DeviceIndex, double> fractions_;
  std::unordered_map<void*, int> pins_; // allocations in checkpoint states, how many
  std::unordered_map<void*, Alloc> parked_; // of those, freed by torch
  std::vector<CCA::OutOfMemoryObserver> oom_observers_;
  // Allocations torch freed whose memory may not be reused yet (while history is recorded).
  std::map<uintptr_t, Awaiting> awaiting_[kMaxDevices];
  std::atomic<size_t> awaiting_count_[kMaxDevices] = {};
  std::atomic<uint64_t> awaiting_seq_{0};

  // History (see the top of the file).
  std::mutex hist_mu_; // what follows, up to the converter (no other lock taken while held)
  std::atomic<bool> recording_{false};
  std::atomic<int> when_{0}; // RecordContext while recording, else NEVER
  std::atomic<CCA::CreateContextFn> recorder_{nullptr};
  size_t max_entries_ = 1;
  std::set<int> skip_; // actions not recorded
  Ring<CCA::TraceEntry> rings_[kMaxDevices];
  Ring<c10::CachingDeviceAllocator::AnnotationEntry> annotations_;
  std::vector<std::string> compile_contexts_;
  std::string user_metadata_;
  std::shared_ptr<const std::vector<CCA::AllocatorTraceTracker>> trackers_;
  std::atomic<bool> have_trackers_{false};
  c10::ApproximateClockToUnixTimeConverter clock_; // the entries' times to Unix time

  std::once_flag driver_once_;
  AddressRangeFn address_range_ = nullptr; // the driver's, when it can be found

  std::mutex ipc_mu_;
  std::unordered_map<std::string, std::weak_ptr<void>> ipc_;
};

PoolState::~PoolState() {
  if (g_backend != nullptr) {
    g_backend->unpin(allocs);
  }
}

void deleter(void* ptr) {
  g_backend->free(ptr);
}

} // namespace streamalloc_torch

extern "C" {

int streamalloc_torch_host_install(void* lib, char* err, size_t errlen); // host.cpp: the pinned pool

// Makes streamalloc torch's CUDA allocator, over the libstreamalloc.so at `lib_path`. Returns
// 0, or -1 with the reason in `err` (torch's allocator already in use, a function missing from
// the library). Call before torch's first CUDA allocation; a second call does nothing.
__attribute__((visibility("default"))) int streamalloc_torch_backend_install(
    const char* lib_path,
    char* err,
    size_t errlen) {
  using namespace streamalloc_torch;
  if (g_backend != nullptr) {
    return 0;
  }
  try {
    void* handle = dlopen(lib_path, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      set_error(err, errlen, std::string("dlopen failed: ") + (why ? why : "?"));
      return -1;
    }
    Lib lib;
    std::string missing;
    resolve(handle, "streamalloc_allocate", lib.allocate, missing);
    resolve(handle, "streamalloc_free", lib.free, missing);
    resolve(handle, "streamalloc_deallocate", lib.deallocate, missing);
    resolve(handle, "streamalloc_record_stream", lib.record_stream, missing);
    resolve(handle, "streamalloc_stats", lib.stats, missing);
    resolve(handle, "streamalloc_reset_peak_stats", lib.reset_peak_stats, missing);
    resolve(handle, "streamalloc_enable_peer_access", lib.enable_peer_access, missing);
    resolve(handle, "streamalloc_last_error", lib.last_error, missing);
    resolve(handle, "streamalloc_pool_begin", lib.pool_begin, missing);
    resolve(handle, "streamalloc_pool_end", lib.pool_end, missing);
    resolve(handle, "streamalloc_pool_release", lib.pool_release, missing);
    resolve(handle, "streamalloc_set_memory_fraction", lib.set_memory_fraction, missing);
    resolve(handle, "streamalloc_torch_base_allocation", lib.base_allocation, missing);
    resolve(handle, "streamalloc_torch_empty_cache", lib.empty_cache, missing);
    resolve(handle, "streamalloc_torch_init", lib.init, missing);
    resolve(handle, "streamalloc_ipc_export", lib.ipc_export, missing);
    resolve(handle, "streamalloc_ipc_open", lib.ipc_open, missing);
    resolve(handle, "streamalloc_ipc_close", lib.ipc_close, missing);
    if (!missing.empty()) {
      set_error(err, errlen, std::string(lib_path) + " lacks " + missing);
      return -1;
    }
    // Held for the life of the process (never destroyed: tensors and checkpoint states may
    // outlive every other static object).
    auto* keep = new std::shared_ptr<Backend>(std::make_shared<Backend>(lib));
    g_backend = keep->get();
    try {
      torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(*keep);
    } catch (...) {
      g_backend = nullptr;
      throw;
    }
    // Also what c10::GetAllocator(kCUDA) / getDeviceAllocator(kCUDA) answer (torch.accelerator).
    c10::SetAllocator(c10::DeviceType::CUDA, keep->get(), 0);
    return streamalloc_torch_host_install(handle, err, errlen);
  } catch (const std::exception& e) {
    set_error(err, errlen, e.what());
    return -1;
  } catch (...) {
    set_error(err, errlen, "unknown C++ exception");
    return -1;
  }
}

// Whether streamalloc_torch_backend_install succeeded in this process.
__attribute__((visibility("default"))) int streamalloc_torch_backend_installed() {
  return streamalloc_torch::g_backend != nullptr ? 1 : 0;
}

} // extern "C"
