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
// the other Python functions) and resolves every function it calls by name. Its types come
// from its generated header (lib.h includes it; host.cpp shares it).
//
// The library keeps the books: what torch needs per allocation rides in its pointer table
// (Note [the word]), which private pool takes an allocation is the library's routing, and the
// snapshot is its list of segments. Allocation and free take no lock of the backend's own
// (counts are atomics); the locks below serve private pools' books and history.
// See DESIGN.md, Note [the backend only translates].
//
// What each of torch's methods does here:
//   allocate / raw_alloc*           streamalloc_allocate_word on torch's current stream; failure from
//                                   lack of memory (or the memory fraction) calls torch's OOM
//                                   observers and throws c10::OutOfMemoryError
//                                   (torch.cuda.OutOfMemoryError) with the library's diagnostic
//   raw_delete / the deleter        streamalloc_free_word (hinted with the current device and
//                                   stream), which hands back what the library kept
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
//   setCheckpointPoolState          setting it frees what is live in the pool and hands the
//                                   state's allocations out again at their addresses
//                                   (streamalloc_pool_allocate_at), as native does
//   shareIpcHandle / getIpcDevPtr   in torch's own formats, so that a process under torch's
//                                   allocator opens what this one shares and this one opens
//                                   torch's: cuMemAlloc chunks (strategy=plain, backing=chunks)
//                                   as 'c' (cudaIpcMemHandle_t), mapped memory (stitched, the
//                                   default, or segments) as 'e' (torch's expandable-segment
//                                   layout, streamalloc_ipc_export; the receiver copies file
//                                   descriptors with pidfd_getfd); the library's own driver
//                                   pool (strategy=async,pool=ipc) as its 'p' (version 0xff,
//                                   streamalloc receivers only); the device's default pool
//                                   refused with the reason. See Note [IPC formats]
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
//                   request).
//   OOM             an allocation refused for lack of memory (addr: the device's free bytes)
//   SNAPSHOT        a snapshot was taken (in the next snapshot's traces, as native)
// SEGMENT_ALLOC / SEGMENT_FREE / SEGMENT_MAP / SEGMENT_UNMAP are not recorded: the library's
// counters say that it called the device, not which range it got or gave back.
// Snapshot. snapshot() is the library's list of its segments and blocks
// (streamalloc_segments), device by device: each segment as the library holds it (address,
// size, stream, private pool), each block allocated (a live allocation, its requested size
// and context from the library's entry), active_pending_free (freed, its reuse waiting for
// recorded streams) or inactive (free). Memory of a MemPool allocator of its own is not the
// library's: each such allocation is a segment of one block. device_traces are the rings,
// oldest first, times in Unix microseconds.
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
#include <shared_mutex>
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

// The library's functions, typed by its header.
struct Lib {
  decltype(&::streamalloc_allocate_word) allocate_word = nullptr;
  decltype(&::streamalloc_free_word) free_word = nullptr;
  decltype(&::streamalloc_entry) entry = nullptr;
  decltype(&::streamalloc_pool_live) pool_live = nullptr;
  decltype(&::streamalloc_pool_allocate_at) pool_allocate_at = nullptr;
  decltype(&::streamalloc_segments) segments = nullptr;
  decltype(&::streamalloc_record_stream) record_stream = nullptr;
  decltype(&::streamalloc_stats) stats = nullptr;
  decltype(&::streamalloc_reset_peak_stats) reset_peak_stats = nullptr;
  decltype(&::streamalloc_enable_peer_access) enable_peer_access = nullptr;
  decltype(&::streamalloc_last_error) last_error = nullptr;
  decltype(&::streamalloc_pool_begin) pool_begin = nullptr;
  decltype(&::streamalloc_pool_end) pool_end = nullptr;
  decltype(&::streamalloc_pool_release) pool_release = nullptr;
  decltype(&::streamalloc_set_memory_fraction) set_memory_fraction = nullptr;
  decltype(&::streamalloc_torch_base_allocation) base_allocation = nullptr;
  decltype(&::streamalloc_torch_empty_cache) empty_cache = nullptr;
  decltype(&::streamalloc_torch_init) init = nullptr;
  decltype(&::streamalloc_ipc_export) ipc_export = nullptr;
  decltype(&::streamalloc_ipc_open) ipc_open = nullptr;
  decltype(&::streamalloc_ipc_close) ipc_close = nullptr;
};

// --- the allocator ----------------------------------------------------------------------------

constexpr size_t kSmallSize = 1 << 20; // torch's small pool: requests up to 1 MiB
constexpr int kMaxDevices = 64;

// Fails (as torch's allocators do) for a device index the backend keeps no books for.
void check_device(c10::DeviceIndex device) {
  // A DeviceIndex is an int8_t, which a stream prints as a character: printed as an int.
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "streamalloc: device ", static_cast<int>(device), " out of range");
}

MempoolId_t pool_of(const streamalloc_entry_t& e) {
  return e.in_pool ? MempoolId_t{e.pool_hi, e.pool_lo} : MempoolId_t{0, 0};
}

// What the backend knows of one allocation (from the library's entry, or its own for a
// MemPool allocator's memory).
struct Alloc {
  size_t size = 0;
  c10::DeviceIndex device = 0;
  cudaStream_t stream = nullptr;
  MempoolId_t pool{0, 0};
  bool recorded = false; // streams other than `stream` were recorded on it
  std::shared_ptr<c10::GatheredContext> context; // torch's context when allocated (history)
};

// The word the library keeps for an allocation made while history records contexts (else 0):
// a pointer to this, deleted when the library's entry goes (see Note [the word]).
struct Extra {
  std::shared_ptr<c10::GatheredContext> context;
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

using Filter = std::shared_ptr<std::function<bool(cudaStream_t)>>;

// torch's bookkeeping of one private pool (use counts, flags); its allocations are the
// library's, except with a MemPool allocator of its own (`allocator`), whose live ones the
// backend keeps in `foreign`.
struct Pool {
  int use_count = 0;
  bool use_on_oom = false;
  bool no_split = false;
  std::shared_ptr<CCA::CUDAAllocator> allocator; // MemPool(allocator): allocations go there
  std::unordered_map<void*, Alloc> foreign; // with `allocator`: its live allocations
};

// One of torch's statistics kept without a lock: current and peak, allocated and freed.
struct AtomicStat {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> freed{0};

  void add(int64_t n) {
    int64_t now = current.fetch_add(n, std::memory_order_relaxed) + n;
    allocated.fetch_add(n, std::memory_order_relaxed);
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
  void sub(int64_t n) {
    current.fetch_sub(n, std::memory_order_relaxed);
    freed.fetch_add(n, std::memory_order_relaxed);
  }
  Stat read() const {
    Stat s;
    s.current = current.load(std::memory_order_relaxed);
    s.peak = peak.load(std::memory_order_relaxed);
    s.allocated = allocated.load(std::memory_order_relaxed);
    s.freed = freed.load(std::memory_order_relaxed);
    return s;
  }
  void reset_peak() {
    peak.store(current.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
  void reset_accumulated() {
    allocated.store(0, std::memory_order_relaxed);
    freed.store(0, std::memory_order_relaxed);
  }
};

constexpr size_t kStatTypes = static_cast<size_t>(StatType::NUM_TYPES);

// Per-device counts of torch's own allocations (the library counts every face's), updated
// without a lock on the hot path.
struct Counts {
  AtomicStat allocation[kStatTypes];
  AtomicStat allocated_bytes[kStatTypes];
  // Out-of-memory errors raised (torch's num_ooms: the library does not count the memory
  // fraction's refusals as failures).
  std::atomic<int64_t> ooms{0};
  std::mutex mu; // what follows (statistics calls only)
  Stat segment;
  // The library's accumulated counters when the accumulated statistics were last reset.
  LibStats base{};
};

void deleter(void* ptr);

class Backend;
Backend* g_backend = nullptr;

// A private pool's state for cudagraph trees: the pool's live allocations when taken.
struct PoolState : public CCA::AllocatorState {
  c10::DeviceIndex device;
  MempoolId_t id;
  std::vector<std::pair<void*, Alloc>> allocs;
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

// Note [the word]: the library's pointer table keeps, per allocation, its size, stream,
// private pool and one word of ours (streamalloc_allocate_word); the free hands them back
// (streamalloc_free_word). So the backend keeps no table of allocations and takes no lock of
// its own to allocate or free: the library's table is sharded by stream. The word is 0 unless
// history records contexts, when it points to an Extra holding the allocation's context,
// deleted once the library's entry is gone (its free); readers of another thread's Extra
// (snapshot, checkpoints) hold extra_mu_ shared, and its deleters hold it alone, only while
// history records contexts.

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

  // The library's entry for `ptr`, as an Alloc (context from its Extra; extra_mu_ held
  // shared by the caller while history records contexts); false if it is none of the library's.
  bool lookup(void* ptr, Alloc& a) {
    streamalloc_entry_t e{};
    if (lib_.entry(ptr, &e) != OK) {
      return false;
    }
    a = from_entry(e, false);
    return true;
  }

  // An entry as an Alloc; with `take`, its Extra is consumed (the entry is gone).
  static Alloc from_entry(const streamalloc_entry_t& e, bool take) {
    Alloc a;
    a.size = e.size;
    a.device = static_cast<c10::DeviceIndex>(e.device);
    a.stream = e.stream;
    a.pool = pool_of(e);
    a.recorded = e.recorded;
    if (e.word != 0) {
      auto* extra = reinterpret_cast<Extra*>(static_cast<uintptr_t>(e.word));
      a.context = extra->context;
      if (take) {
        delete extra;
      }
    }
    return a;
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

  // The MemPool allocator of the pool whose filter takes an allocation on `stream`, if a pool
  // with an allocator of its own is active on `device` (the library routes among its own
  // pools; these it does not serve). Such pools are asked first.
  std::shared_ptr<CCA::CUDAAllocator> foreign_route(c10::DeviceIndex device, cudaStream_t stream, MempoolId_t& id) {
    if (foreign_active_[device].load(std::memory_order_acquire) == 0) {
      return nullptr;
    }
    std::vector<std::pair<MempoolId_t, Filter>> active;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      active = foreign_filters_[device];
    }
    for (auto it = active.rbegin(); it != active.rend(); ++it) {
      if ((*it->second)(stream)) {
        id = it->first;
        std::lock_guard<std::mutex> lock(pools_mu_);
        auto pool = pools_.find(PoolKey{device, id});
        return pool == pools_.end() ? nullptr : pool->second.allocator;
      }
    }
    return nullptr;
  }

  void* malloc(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    check_device(device);
    Alloc a;
    a.size = size;
    a.device = device;
    a.stream = stream;
    // Outside every lock: torch's recorder takes the GIL.
    a.context = gather(CCA::RecordContext::STATE);
    void* p = nullptr;
    if (auto allocator = foreign_route(device, stream, a.pool)) {
      // torch.cuda.MemPool(allocator): the pool's own allocator serves it (it throws itself).
      p = allocator->raw_alloc_with_stream(size, stream);
      std::lock_guard<std::mutex> lock(pools_mu_);
      pools_[PoolKey{device, a.pool}].foreign[p] = a;
      foreign_live_.fetch_add(1, std::memory_order_relaxed);
    } else {
      Extra* extra = a.context ? new Extra{a.context} : nullptr;
      uint64_t word = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(extra));
      streamalloc_entry_t e{};
      int status = lib_.allocate_word(size, device, stream, word, &p, &e);
      if (status != OK) {
        std::string message = last_error();
        bool oom = status == OUT_OF_MEMORY || status == LIMIT_EXCEEDED;
        if (oom && try_oom_pools(size, device, stream, word, p, e)) {
          status = OK;
        }
        if (status != OK) {
          delete extra;
          if (oom) {
            out_of_memory(size, device, stream, message, a.context);
          }
          TORCH_CHECK(false, "streamalloc: allocating ", size, " bytes on device ", static_cast<int>(device),
                      " failed: ", message);
        }
      }
      a.pool = pool_of(e);
    }
    note_alloc(p, a);
    return p;
  }

  // Pools made with use_on_oom=True take an allocation the device could not serve.
  bool try_oom_pools(
      size_t size,
      c10::DeviceIndex device,
      cudaStream_t stream,
      uint64_t word,
      void*& p,
      streamalloc_entry_t& e) {
    std::vector<MempoolId_t> ids;
    std::lock_guard<std::mutex> order(pool_calls_mu_);
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      for (auto& [key, pool] : pools_) {
        if (key.device == device && pool.use_on_oom && pool.use_count > 0 && !pool.allocator) {
          ids.push_back(key.id);
        }
      }
    }
    for (const auto& id : ids) {
      auto* me = new std::thread::id(std::this_thread::get_id());
      if (lib_.pool_begin(device, id.first, id.second, &this_thread, me, &drop_thread) != OK) {
        continue;
      }
      int status = lib_.allocate_word(size, device, stream, word, &p, &e);
      lib_.pool_end(device, id.first, id.second);
      lib_.pool_release(device, id.first, id.second);
      if (status == OK) {
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
      std::lock_guard<std::mutex> lock(pools_mu_);
      observers = oom_observers_;
    }
    counts_[device].ooms.fetch_add(1, std::memory_order_relaxed);
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
    count(a, +1);
    if (!recording_.load(std::memory_order_acquire) && !have_trackers_.load(std::memory_order_acquire)) {
      return;
    }
    poll_awaiting(a.device);
    std::vector<std::pair<uintptr_t, Alloc>> reused;
    if (awaiting_count_[a.device].load(std::memory_order_relaxed) > 0) {
      std::lock_guard<std::mutex> lock(awaiting_mu_);
      take_overlapping(a.device, reinterpret_cast<uintptr_t>(p), a.size, reused);
    }
    // Memory the library handed out again: those frees completed before.
    for (auto& [addr, old] : reused) {
      record(CCA::TraceEntry::FREE_COMPLETED, old.device, addr, old.size, old.stream, old.pool, old.context);
    }
    record(CCA::TraceEntry::ALLOC, a.device, reinterpret_cast<size_t>(p), a.size, a.stream, a.pool, a.context);
  }

  // Moves the awaiting frees of `device` that overlap [addr, addr + size) to `out`;
  // awaiting_mu_ held.
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
      std::lock_guard<std::mutex> lock(awaiting_mu_);
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

  // Adds (+1) or removes (-1) `a` from the counts, without a lock.
  void count(const Alloc& a, int sign) {
    Counts& c = counts_[a.device];
    auto kind = static_cast<size_t>(a.size <= kSmallSize ? StatType::SMALL_POOL : StatType::LARGE_POOL);
    for (size_t k : {static_cast<size_t>(StatType::AGGREGATE), kind}) {
      if (sign > 0) {
        c.allocation[k].add(1);
        c.allocated_bytes[k].add(static_cast<int64_t>(a.size));
      } else {
        c.allocation[k].sub(1);
        c.allocated_bytes[k].sub(static_cast<int64_t>(a.size));
      }
    }
  }

  // torch frees `ptr` (its deleter, raw_delete). A deleter must not throw: whatever fails
  // (a trace tracker, a MemPool allocator's raw_delete, the library) is written to stderr.
  void free(void* ptr) noexcept {
    if (ptr == nullptr) {
      return;
    }
    try {
      free_or_throw(ptr);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "streamalloc: freeing %p: %s\n", ptr, e.what());
    } catch (...) {
      std::fprintf(stderr, "streamalloc: freeing %p: an unknown C++ exception\n", ptr);
    }
  }

  void free_or_throw(void* ptr) {
    // Outside every lock: torch's recorder takes the GIL.
    std::shared_ptr<c10::GatheredContext> context = gather(CCA::RecordContext::ALL);
    bool traced = recording_.load(std::memory_order_acquire) || have_trackers_.load(std::memory_order_acquire);
    if (traced) {
      // The request is recorded before the library may hand the memory out again.
      Alloc a;
      bool known = false;
      {
        std::shared_lock<std::shared_mutex> lock(extra_mu_);
        known = lookup(ptr, a);
      }
      if (known) {
        record(CCA::TraceEntry::FREE_REQUESTED, a.device, reinterpret_cast<size_t>(ptr), a.size, a.stream, a.pool,
               context ? context : a.context);
      }
    }
    streamalloc_entry_t e{};
    int status = free_in_library(ptr, e);
    if (status != OK) {
      if (foreign_live_.load(std::memory_order_acquire) > 0 && free_foreign(ptr, context)) {
        return;
      }
      // Not made through this backend (nothing else hands torch streamalloc memory).
      std::fprintf(stderr, "streamalloc: freeing %p: %s\n", ptr, last_error().c_str());
      return;
    }
    Alloc a = take_entry(e);
    count(a, -1);
    if (!traced) {
      return;
    }
    completed(ptr, a, context);
  }

  // streamalloc_free_word with this thread's current device and stream as the hints (torch
  // mostly frees where it allocated; any other is found too).
  int free_in_library(void* ptr, streamalloc_entry_t& e) {
    int device = -1;
    cudaStream_t stream = nullptr;
    if (cudaGetDevice(&device) == cudaSuccess) {
      stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
    } else {
      (void)cudaGetLastError();
    }
    return lib_.free_word(ptr, device, stream, &e);
  }

  // The Alloc of an entry the library gave back, its Extra consumed (Note [the word]).
  Alloc take_entry(const streamalloc_entry_t& e) {
    if (e.word == 0) {
      return from_entry(e, false);
    }
    std::unique_lock<std::shared_mutex> lock(extra_mu_);
    return from_entry(e, true);
  }

  // The completion of a free of `a` at `ptr` (see History).
  void completed(void* ptr, const Alloc& a, const std::shared_ptr<c10::GatheredContext>& context) {
    if (a.recorded && recording_.load(std::memory_order_acquire)) {
      // Its reuse waits for the other streams' work (tracked while history is recorded).
      {
        std::lock_guard<std::mutex> lock(awaiting_mu_);
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
    record(CCA::TraceEntry::FREE_COMPLETED, a.device, reinterpret_cast<size_t>(ptr), a.size, a.stream, a.pool,
           context ? context : a.context);
  }

  // A free of memory a MemPool allocator of its own made; whether `ptr` was such.
  bool free_foreign(void* ptr, const std::shared_ptr<c10::GatheredContext>& context) {
    std::shared_ptr<CCA::CUDAAllocator> allocator;
    Alloc a;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      for (auto it = pools_.begin(); it != pools_.end(); ++it) {
        auto found = it->second.foreign.find(ptr);
        if (found == it->second.foreign.end()) {
          continue;
        }
        a = std::move(found->second);
        allocator = it->second.allocator;
        it->second.foreign.erase(found);
        foreign_live_.fetch_sub(1, std::memory_order_relaxed);
        if (it->second.use_count <= 0 && it->second.foreign.empty()) {
          pools_.erase(it);
        }
        break;
      }
    }
    if (!allocator) {
      return false;
    }
    count(a, -1);
    record(CCA::TraceEntry::FREE_REQUESTED, a.device, reinterpret_cast<size_t>(ptr), a.size, a.stream, a.pool,
           context ? context : a.context);
    allocator->raw_delete(ptr);
    record(CCA::TraceEntry::FREE_COMPLETED, a.device, reinterpret_cast<size_t>(ptr), a.size, a.stream, a.pool,
           context ? context : a.context);
    return true;
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
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = fractions_.find(device);
    return it == fractions_.end() ? 1.0 : it->second;
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check(lib_.set_memory_fraction(device, fraction), "set_per_process_memory_fraction");
    std::lock_guard<std::mutex> lock(pools_mu_);
    fractions_[device] = fraction;
  }

  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};
  }

  // As native answers, so that cudnn is offered the same workspace: see DESIGN.md,
  // Note [step times under cudnn.benchmark].
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
    if (foreign_live_.load(std::memory_order_acquire) > 0) {
      std::shared_ptr<CCA::CUDAAllocator> allocator;
      {
        std::lock_guard<std::mutex> lock(pools_mu_);
        for (auto& [key, pool] : pools_) {
          if (pool.foreign.count(ptr.get()) != 0) {
            allocator = pool.allocator;
            break;
          }
        }
      }
      if (allocator) { // memory of a MemPool's own allocator: its record_stream
        allocator->recordStream(ptr, stream);
        return;
      }
    }
    check(lib_.record_stream(ptr.get(), stream.stream()), "record_stream");
  }

  // --- statistics ---

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device(device);
    LibStats s{};
    check(lib_.stats(device, &s), "memory_stats");
    Counts& c = counts_[device];
    DeviceStats d;
    const auto all = static_cast<size_t>(StatType::AGGREGATE);
    const auto large = static_cast<size_t>(StatType::LARGE_POOL);
    // Allocations and their bytes, current, peak and accumulated: the backend's count of torch's
    // tensors, as torch's own allocators count them (down at torch's free, also when the memory
    // waits for a recorded stream). Not the
    // library's allocated_peak: under a stream-ordered strategy that adds up the peaks of each
    // stream's pool, which overstates the peak of all of them together.
    for (size_t k = 0; k < kStatTypes; k++) {
      d.allocation[k] = c.allocation[k].read();
      d.allocated_bytes[k] = c.allocated_bytes[k].read();
    }
    d.active = d.allocation;
    d.active_bytes = d.allocated_bytes;
    d.requested_bytes = d.allocated_bytes; // the library counts sizes as asked for
    for (size_t k : {all, large}) { // reserved memory is not split by request size
      d.reserved_bytes[k].current = static_cast<int64_t>(s.reserved);
      d.reserved_bytes[k].peak = static_cast<int64_t>(s.reserved_peak);
    }
    d.inactive_split_bytes[all].current = static_cast<int64_t>(s.cached);
    std::lock_guard<std::mutex> lock(c.mu);
    const LibStats& b = c.base;
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
    d.num_ooms = c.ooms.load(std::memory_order_relaxed);
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
    Counts& c = counts_[device];
    for (size_t k = 0; k < kStatTypes; k++) {
      c.allocation[k].reset_accumulated();
      c.allocated_bytes[k].reset_accumulated();
    }
    c.ooms.store(0, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(c.mu);
    c.segment.reset_accumulated();
    c.base = s;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_device(device);
    check(lib_.reset_peak_stats(device), "reset_peak_memory_stats");
    Counts& c = counts_[device];
    for (size_t k = 0; k < kStatTypes; k++) {
      c.allocation[k].reset_peak();
      c.allocated_bytes[k].reset_peak();
    }
    std::lock_guard<std::mutex> lock(c.mu);
    c.segment.reset_peak();
  }

  // The library's segments and blocks of `device` (streamalloc_segments), asked until the
  // arrays it is given fit.
  void library_segments(
      int device,
      std::vector<streamalloc_segment_t>& segments,
      std::vector<streamalloc_block_t>& blocks) {
    for (;;) {
      size_t ns = 0;
      size_t nb = 0;
      int status = lib_.segments(device, segments.data(), segments.size(), blocks.data(), blocks.size(), &ns, &nb);
      if (status == OK) {
        segments.resize(ns);
        blocks.resize(nb);
        return;
      }
      TORCH_CHECK(
          status == INVALID_ARGUMENT && (ns > segments.size() || nb > blocks.size()),
          "streamalloc: memory snapshot of device ", device, " failed: ", last_error());
      // Room for what it said, and for some growth meanwhile.
      segments.resize(ns + ns / 4 + 4);
      blocks.resize(nb + nb / 4 + 4);
    }
  }

  // See "Snapshot" at the top of the file.
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
    int devices = std::min(std::max(device_count_, 0), kMaxDevices);
    for (c10::DeviceIndex d = 0; d < devices; d++) {
      poll_awaiting(d);
    }
    std::vector<size_t> active_bytes(kMaxDevices, 0);
    std::vector<streamalloc_segment_t> segments;
    std::vector<streamalloc_block_t> blocks;
    for (int d = 0; d < devices; d++) {
      library_segments(d, segments, blocks);
      std::shared_lock<std::shared_mutex> extra(extra_mu_);
      for (const auto& s : segments) {
        MempoolId_t pool = pool_of_segment(s);
        if (!all_pools && pool != mempool_id) {
          continue;
        }
        c10::CachingDeviceAllocator::SegmentInfo seg;
        seg.device = static_cast<c10::DeviceIndex>(d);
        seg.address = s.addr;
        seg.total_size = s.size;
        seg.stream = s.stream;
        seg.owner_private_pool_id = pool;
        seg.is_large = s.size > kSmallSize;
        for (size_t i = s.first_block; i < s.first_block + s.blocks && i < blocks.size(); i++) {
          const streamalloc_block_t& b = blocks[i];
          c10::CachingDeviceAllocator::BlockInfo block;
          block.size = b.size;
          block.requested_size = b.size;
          void* p = reinterpret_cast<void*>(b.addr);
          Alloc a;
          bool live = b.state == STREAMALLOC_BLOCK_ALLOCATED && lookup(p, a);
          if (live) {
            block.requested_size = a.size;
            block.context_when_allocated = a.context;
          }
          block.allocated = live;
          block.active = b.state != STREAMALLOC_BLOCK_FREE;
          if (block.allocated) {
            seg.allocated_size += b.size;
            seg.requested_size += block.requested_size;
            active_bytes[d] += b.size;
          }
          if (block.active) {
            seg.active_size += b.size;
          }
          seg.blocks.push_back(std::move(block));
        }
        info.segments.push_back(std::move(seg));
      }
    }
    snapshot_foreign(mempool_id, info.segments, active_bytes);

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

  static MempoolId_t pool_of_segment(const streamalloc_segment_t& s) {
    return s.in_pool ? MempoolId_t{s.pool_hi, s.pool_lo} : MempoolId_t{0, 0};
  }

  // Memory of MemPool allocators of their own (not the library's): each allocation a segment
  // of one block, as far as the backend knows it.
  void snapshot_foreign(
      MempoolId_t mempool_id,
      std::vector<c10::CachingDeviceAllocator::SegmentInfo>& segments,
      std::vector<size_t>& active_bytes) {
    if (foreign_live_.load(std::memory_order_acquire) == 0) {
      return;
    }
    bool all_pools = mempool_id.first == 0 && mempool_id.second == 0;
    std::lock_guard<std::mutex> lock(pools_mu_);
    for (const auto& [key, pool] : pools_) {
      if (!all_pools && key.id != mempool_id) {
        continue;
      }
      for (const auto& [p, a] : pool.foreign) {
        c10::CachingDeviceAllocator::SegmentInfo seg;
        seg.device = a.device;
        seg.address = reinterpret_cast<size_t>(p);
        seg.total_size = a.size;
        seg.allocated_size = seg.active_size = seg.requested_size = a.size;
        seg.stream = a.stream;
        seg.owner_private_pool_id = key.id;
        seg.is_large = a.size > kSmallSize;
        c10::CachingDeviceAllocator::BlockInfo block;
        block.size = block.requested_size = a.size;
        block.allocated = block.active = true;
        block.context_when_allocated = a.context;
        seg.blocks.push_back(std::move(block));
        segments.push_back(std::move(seg));
        active_bytes[a.device] += a.size;
      }
    }
  }

  // --- private pools (CUDA graphs, torch.cuda.MemPool, use_mem_pool) ---

  void beginAllocateToPool(
      c10::DeviceIndex device,
      MempoolId_t mempool_id,
      std::function<bool(cudaStream_t)> filter) override {
    check_device(device);
    auto shared = std::make_shared<std::function<bool(cudaStream_t)>>(std::move(filter));
    std::lock_guard<std::mutex> order(pool_calls_mu_);
    bool own_allocator;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      Pool& pool = pools_[PoolKey{device, mempool_id}];
      own_allocator = static_cast<bool>(pool.allocator);
      pool.use_count += 1;
      if (own_allocator) {
        foreign_filters_[device].emplace_back(mempool_id, shared);
        foreign_active_[device].store(foreign_filters_[device].size(), std::memory_order_release);
      }
    }
    if (!own_allocator) {
      auto* context = new Filter(shared);
      int status = lib_.pool_begin(device, mempool_id.first, mempool_id.second, &call_filter, context, &drop_filter);
      if (status != OK) {
        std::string message = last_error();
        std::lock_guard<std::mutex> lock(pools_mu_);
        pools_[PoolKey{device, mempool_id}].use_count -= 1;
        TORCH_CHECK(false, "streamalloc: beginAllocateToPool failed: ", message);
      }
    }
  }

  // Removes the newest filter of `id` on `device` (a pool with an allocator of its own);
  // pools_mu_ held.
  void remove_foreign_filter(c10::DeviceIndex device, MempoolId_t id) {
    auto& active = foreign_filters_[device];
    for (auto it = active.rbegin(); it != active.rend(); ++it) {
      if (it->first == id) {
        active.erase(std::next(it).base());
        break;
      }
    }
    foreign_active_[device].store(active.size(), std::memory_order_release);
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    check_device(device);
    std::lock_guard<std::mutex> order(pool_calls_mu_);
    bool own_allocator = false;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      auto pool = pools_.find(PoolKey{device, mempool_id});
      own_allocator = pool != pools_.end() && pool->second.allocator;
      if (own_allocator) {
        remove_foreign_filter(device, mempool_id);
      }
    }
    if (!own_allocator) {
      check(lib_.pool_end(device, mempool_id.first, mempool_id.second), "endAllocateToPool");
    }
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    check_device(device);
    std::lock_guard<std::mutex> order(pool_calls_mu_);
    bool own_allocator = false;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      auto pool = pools_.find(PoolKey{device, mempool_id});
      if (pool == pools_.end()) {
        return;
      }
      own_allocator = static_cast<bool>(pool->second.allocator);
      pool->second.use_count = std::max(pool->second.use_count - 1, 0);
      if (pool->second.use_count == 0 && pool->second.foreign.empty()) {
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
    std::lock_guard<std::mutex> order(pool_calls_mu_);
    bool own_allocator;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
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
      // at once (no other begin of this pool can come between: pool_calls_mu_ is held).
      int status = lib_.pool_begin(device, mempool_id.first, mempool_id.second, &never, nullptr, nullptr);
      if (status == OK) {
        status = lib_.pool_end(device, mempool_id.first, mempool_id.second);
      }
      if (status != OK) {
        std::string message = last_error();
        std::lock_guard<std::mutex> lock(pools_mu_);
        pools_[PoolKey{device, mempool_id}].use_count -= 1;
        TORCH_CHECK(false, "streamalloc: createOrIncrefPool failed: ", message);
      }
    }
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto pool = pools_.find(PoolKey{device, mempool_id});
    return pool == pools_.end() ? 0 : pool->second.use_count;
  }

  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) override {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto pool = pools_.find(PoolKey{device, mempool_id});
    if (pool != pools_.end()) {
      pool->second.use_on_oom = use_on_oom;
    }
  }

  void setNoSplit(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    // A private pool's blocks are split by the library as it sees fit; the flag is kept so
    // that it reads back, and has no other effect.
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto pool = pools_.find(PoolKey{device, mempool_id});
    if (pool != pools_.end()) {
      pool->second.no_split = true;
    }
  }

  // The live allocations of pool `id` of `device`: the library's (or the pool allocator's).
  std::vector<std::pair<void*, Alloc>> pool_live(c10::DeviceIndex device, MempoolId_t id) {
    std::vector<std::pair<void*, Alloc>> live;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      auto pool = pools_.find(PoolKey{device, id});
      if (pool != pools_.end() && pool->second.allocator) {
        live.assign(pool->second.foreign.begin(), pool->second.foreign.end());
        return live;
      }
    }
    std::vector<void*> ptrs;
    std::vector<streamalloc_entry_t> entries;
    for (;;) {
      size_t n = 0;
      int status = lib_.pool_live(device, id.first, id.second, ptrs.data(), entries.data(), ptrs.size(), &n);
      if (status == OK) {
        ptrs.resize(n);
        entries.resize(n);
        break;
      }
      TORCH_CHECK(status == INVALID_ARGUMENT && n > ptrs.size(), "streamalloc: listing pool (", id.first, ", ",
                  id.second, ") failed: ", last_error());
      ptrs.resize(n + n / 4 + 4);
      entries.resize(ptrs.size());
    }
    std::shared_lock<std::shared_mutex> extra(extra_mu_);
    for (size_t i = 0; i < ptrs.size(); i++) {
      live.emplace_back(ptrs[i], from_entry(entries[i], false));
    }
    return live;
  }

  bool checkPoolLiveAllocations(
      c10::DeviceIndex device,
      MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override {
    std::unordered_set<void*> live;
    for (const auto& entry : pool_live(device, mempool_id)) {
      live.insert(entry.first);
    }
    return live == expected_live_allocations;
  }

  // --- cudagraph trees' checkpoints ---

  std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex device, MempoolId_t id) override {
    auto state = std::make_shared<PoolState>();
    state->device = device;
    state->id = id;
    state->allocs = pool_live(device, id);
    return state;
  }

  // As native: everything live in the pool now is freed, and the checkpoint's allocations are
  // handed out again at their addresses (the library's pool_allocate_at: torch freed them
  // meanwhile, their memory back in the pool, reused or not; torch has freed or will free,
  // as stale, what reused it). One live now at a checkpointed address and size keeps its
  // memory. See Note [checkpoints] in DESIGN.md.
  CCA::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<CCA::AllocatorState> as) override {
    auto state = std::dynamic_pointer_cast<PoolState>(as);
    TORCH_CHECK(state, "streamalloc: setCheckpointPoolState was given another allocator's state");
    TORCH_CHECK(state->device == device, "streamalloc: checkpoint of device ", static_cast<int>(state->device),
                " set on ", static_cast<int>(device));
    CCA::CheckpointDelta delta;
    // History entries, recorded at the end: (action, address, allocation).
    std::vector<std::tuple<CCA::TraceEntry::Action, void*, Alloc>> events;
    std::unordered_map<void*, size_t> wanted; // address -> size
    for (const auto& [p, a] : state->allocs) {
      wanted.emplace(p, a.size);
    }
    std::unordered_set<void*> kept;
    for (const auto& [p, a] : pool_live(device, state->id)) {
      count(a, -1);
      delta.ptrs_freed.push_back(p);
      events.emplace_back(CCA::TraceEntry::FREE_REQUESTED, p, a);
      events.emplace_back(CCA::TraceEntry::FREE_COMPLETED, p, a);
      auto w = wanted.find(p);
      if (w != wanted.end() && w->second == a.size) {
        kept.insert(p);
        continue;
      }
      streamalloc_entry_t e{};
      TORCH_CHECK(free_in_library(p, e) == OK, "streamalloc: restoring a cudagraph trees checkpoint: freeing ", p,
                  ": ", last_error());
      take_entry(e);
    }
    for (const auto& [p, recorded] : state->allocs) {
      if (kept.count(p) == 0) {
        Extra* extra = recorded.context ? new Extra{recorded.context} : nullptr;
        uint64_t word = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(extra));
        int status = lib_.pool_allocate_at(device, state->id.first, state->id.second, p, recorded.size,
                                           recorded.stream, word);
        if (status != OK) {
          delete extra;
          TORCH_CHECK(false, "streamalloc: restoring a cudagraph trees checkpoint of pool (", state->id.first, ", ",
                      state->id.second, "): ", last_error());
        }
      }
      count(recorded, +1);
      delta.dataptrs_allocd.emplace_back(p, p, &deleter, c10::Device(c10::DeviceType::CUDA, device));
      events.emplace_back(CCA::TraceEntry::ALLOC, p, recorded);
    }
    for (const auto& [action, p, a] : events) {
      record(action, a.device, reinterpret_cast<size_t>(p), a.size, a.stream, a.pool, a.context);
    }
    return delta;
  }

  // --- IPC ---

  static constexpr unsigned char kHandleVersion = 2; // torch <= 2.12's SHAREABLE_HANDLE_VERSION
  static constexpr char kCudaMalloc = 'c'; // SHAREABLE_CUDA_MALLOC
  static constexpr char kMapped = 'e'; // SHAREABLE_CUDA_EXPANDABLE_SEGMENT: streamalloc_ipc_export's
  static constexpr char kPool = STREAMALLOC_IPC_POOL_KIND; // the driver's pool (version 0xff)

  // Note [IPC formats]: memory of cuMemAlloc chunks travels as torch's 'c' (a CUDA IPC handle
  // of the chunk); mapped memory as torch's 'e' (ExpandableSegment::share's layout:
  // streamalloc_ipc_export writes it, 2 MiB allocations exported as file descriptors, plus a
  // trailer torch's receiver does not read), so a receiver under torch's own allocator opens
  // either. Memory of the library's own driver pool (strategy=async,pool=ipc) travels as the
  // library's 'p' handle with version byte 0xff: torch's own receiver refuses it with its
  // "future version of torch" error (its getIpcDevPtr checks the version before the kind), a
  // receiver under streamalloc imports it (streamalloc_ipc_open). The device's default pool
  // (strategy=async, pool=default) is refused at put, naming the configs that share.
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
    streamalloc_entry_t entry{};
    if (lib_.entry(ptr, &entry) == OK) {
      alloc_size = entry.size;
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
        "with pidfd_getfd), backing=chunks or strategy=plain (CUDA IPC handles), strategy=async,pool=ipc "
        "(to a receiver under streamalloc only)");
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
    bool mapped =
        handle.size() != CUDA_IPC_HANDLE_SIZE && handle.size() >= 2 && (handle[1] == kMapped || handle[1] == kPool);
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
        handle[1] == kPool || static_cast<unsigned char>(handle[0]) <= kHandleVersion,
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
      std::lock_guard<std::mutex> lock(awaiting_mu_);
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
    std::lock_guard<std::mutex> lock(pools_mu_);
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
  // without another lock of the backend held.
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
    // Mapped memory (backing=stitched) needs the peer copy without peer access.
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

 private:
  Lib lib_;
  bool initialized_ = false;
  bool enabled_ = true;
  int device_count_ = 0;

  // Private pools (torch's books of them) and the rest set rarely; never on the hot path,
  // except with a MemPool allocator of its own.
  std::mutex pools_mu_;
  std::mutex pool_calls_mu_; // orders the library's pool calls (taken before pools_mu_)
  std::unordered_map<PoolKey, Pool, PoolKeyHash> pools_;
  // Active filters of pools with an allocator of their own, by device (the library routes
  // among its own pools).
  std::vector<std::pair<MempoolId_t, Filter>> foreign_filters_[kMaxDevices];
  std::atomic<size_t> foreign_active_[kMaxDevices] = {};
  std::atomic<size_t> foreign_live_{0}; // allocations of those pools' allocators
  std::map<c10::DeviceIndex, double> fractions_;
  std::vector<CCA::OutOfMemoryObserver> oom_observers_;
  Counts counts_[kMaxDevices];
  std::shared_mutex extra_mu_; // see Note [the word]
  // Allocations torch freed whose memory may not be reused yet (while history is recorded).
  std::mutex awaiting_mu_;
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

  std::mutex ipc_mu_;
  std::unordered_map<std::string, std::weak_ptr<void>> ipc_;
};

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
    resolve(handle, "streamalloc_allocate_word", lib.allocate_word, missing);
    resolve(handle, "streamalloc_free_word", lib.free_word, missing);
    resolve(handle, "streamalloc_entry", lib.entry, missing);
    resolve(handle, "streamalloc_pool_live", lib.pool_live, missing);
    resolve(handle, "streamalloc_pool_allocate_at", lib.pool_allocate_at, missing);
    resolve(handle, "streamalloc_segments", lib.segments, missing);
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
