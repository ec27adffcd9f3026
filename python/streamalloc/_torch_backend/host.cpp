// streamalloc's pinned pool as PyTorch's CUDA host allocator: a class implementing
// at::HostAllocator (ATen/core/CachingHostAllocator.h) over libstreamalloc's C ABI
// (streamalloc_host_*), registered with at::setHostAllocator(kCUDA, ..., priority 1) by
// streamalloc_torch_host_install, which backend.cpp's install calls with the library it
// opened. Built with backend.cpp (streamalloc/torch.py lists both sources).
//
// In torch 2.11 every pinned allocation goes through at::getHostAllocator(kCUDA):
// tensor.pin_memory() (at::_pin_memory: Context::getPinnedMemoryAllocator -> CUDAHooks ->
// at::cuda::getPinnedMemoryAllocator(), which is getHostAllocator(kCUDA)), torch.empty(...,
// pin_memory=True) (GetCPUAllocatorMaybePinned, the same hooks), and the DataLoader's pinning
// (pin_memory()); a non_blocking copy between a pinned tensor and a device
// (native/cuda/Copy.cu) calls getHostAllocator(kCUDA)->record_event(ptr, ctx, stream), and
// torch.cuda.host_memory_stats / empty_host_cache reach get_stats / empty_cache. torch's own
// allocator registers itself with priority 0; this one takes its place with priority 1.
//
// What each method does:
//   allocate        streamalloc_host_alloc; the first call names the device whose context
//                   pins the pool's memory: one with a primary context already (the current
//                   device first), as torch's own allocator picks, else the current device.
//                   The DataPtr's context is the block's address.
//   the deleter     streamalloc_host_free (an error goes to stderr: a deleter cannot throw)
//   record_event    streamalloc_host_record_stream on the block (the context, else the
//                   pointer) with the stream's device; memory the pool did not hand out (pinned
//                   by torch's own allocator before the install) goes to that allocator
//   empty_cache     streamalloc_host_release, and torch's own allocator's cache
//   get_stats       torch's HostStats from streamalloc_host_stats: allocations = blocks held,
//                   allocated_bytes = bytes pinned, active_requests = live allocations,
//                   active_bytes = bytes asked for; num_host_alloc / num_host_free. Not
//                   measured: the times of the driver calls and the buckets' figures (0).
//   reset_*         the accumulated figures restart from 0 (a base kept here); the peaks
//                   restart from the current figures (streamalloc_host_reset_peak_stats)
//   begin/end_allocate_to_pool, release_pool
//                   torch.cuda.graph's captures: kept as torch keeps them, so that the calls
//                   succeed; no pool is kept apart, because the library never hands out again
//                   a block that a stream used while capturing (a replay may copy from it at
//                   any time), which is what torch's private host pools are for. While a
//                   capture is under way, library calls run in the relaxed capture mode: in
//                   the global mode an event query or a pinned allocation would invalidate it.

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/Allocator.h>
#include <c10/core/Stream.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "lib.h"

namespace streamalloc_torch_host {

using namespace streamalloc_lib;

struct Lib {
  int (*alloc)(size_t, int, void**) = nullptr;
  int (*free)(void*) = nullptr;
  int (*record_stream)(void*, int, cudaStream_t) = nullptr;
  decltype(&::streamalloc_host_is_live) is_live = nullptr;
  int (*release)(size_t*) = nullptr;
  int (*stats)(LibStats*) = nullptr;
  int (*reset_peak_stats)() = nullptr;
  const char* (*last_error)() = nullptr;
};

void deleter(void* ctx);

// The relaxed capture mode for a library call while a capture is under way (see the top);
// nothing otherwise.
class Relaxed {
 public:
  explicit Relaxed(bool capturing) {
    if (capturing) {
      guard_.emplace(cudaStreamCaptureModeRelaxed);
    }
  }

 private:
  std::optional<c10::cuda::CUDAStreamCaptureModeGuard> guard_;
};

class HostAllocator final : public at::HostAllocator {
 public:
  HostAllocator(Lib lib, at::HostAllocator* previous) : lib_(lib), previous_(previous) {}

  at::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return {nullptr, nullptr, &deleter, at::Device(at::DeviceType::CPU)};
    }
    void* p = nullptr;
    int status;
    {
      Relaxed relaxed(capturing());
      status = lib_.alloc(n, pinning_device(), &p);
    }
    if (status == OUT_OF_MEMORY) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "pinned host memory (streamalloc): ", lib_.last_error());
    }
    check(status, "pinned allocation");
    return {p, p, &deleter, at::Device(at::DeviceType::CPU)};
  }

  at::DeleterFnPtr raw_deleter() const override {
    return &deleter;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // From the deleter, which must not throw: a failure is written to stderr.
  void free(void* block) noexcept {
    try {
      Relaxed relaxed(capturing());
      if (lib_.free(block) != OK) {
        std::fprintf(stderr, "streamalloc: freeing pinned memory %p: %s\n", block, lib_.last_error());
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "streamalloc: freeing pinned memory %p: %s\n", block, e.what());
    }
  }

  bool record_event(void* ptr, void* ctx, c10::Stream stream) override {
    void* block = ctx != nullptr ? ctx : ptr;
    c10::cuda::CUDAStream cuda(c10::cuda::CUDAStream::UNCHECKED, stream);
    int status;
    {
      Relaxed relaxed(capturing());
      status = lib_.record_stream(block, static_cast<int>(stream.device_index()), cuda.stream());
    }
    if (status == INVALID_ARGUMENT && !lib_.is_live(block)) {
      // Not a block of the pool: pinned by torch's own allocator before the install. (A
      // block of the pool refused for another reason, a bad stream, is an error: dropping
      // the record would let the block be reused under the copy.)
      return previous_ != nullptr && previous_->record_event(ptr, ctx, stream);
    }
    check(status, "record_event");
    return true;
  }

  void empty_cache() override {
    size_t released = 0;
    {
      Relaxed relaxed(capturing());
      check(lib_.release(&released), "empty_host_cache");
    }
    if (previous_ != nullptr) {
      previous_->empty_cache();
    }
  }

  at::HostStats get_stats() override {
    LibStats s = lib_stats();
    std::lock_guard<std::mutex> lock(mu_);
    at::HostStats h;
    int64_t blocks = static_cast<int64_t>(s.device_allocs) - static_cast<int64_t>(s.device_frees);
    blocks_peak_ = std::max(blocks_peak_, blocks);
    requests_peak_ = std::max(requests_peak_, static_cast<int64_t>(s.live_allocations));
    h.allocations.current = blocks;
    h.allocations.peak = blocks_peak_;
    h.allocations.allocated = static_cast<int64_t>(s.device_allocs - base_.device_allocs);
    h.allocations.freed = static_cast<int64_t>(s.device_frees - base_.device_frees);
    h.allocated_bytes.current = static_cast<int64_t>(s.reserved);
    h.allocated_bytes.peak = static_cast<int64_t>(s.reserved_peak);
    h.active_requests.current = static_cast<int64_t>(s.live_allocations);
    h.active_requests.peak = requests_peak_;
    h.active_requests.allocated = static_cast<int64_t>(s.total_allocations - base_.total_allocations);
    h.active_requests.freed = static_cast<int64_t>(s.total_frees - base_.total_frees);
    h.active_bytes.current = static_cast<int64_t>(s.allocated);
    h.active_bytes.peak = static_cast<int64_t>(s.allocated_peak);
    h.num_host_alloc = static_cast<int64_t>(s.device_allocs - base_.device_allocs);
    h.num_host_free = static_cast<int64_t>(s.device_frees - base_.device_frees);
    return h;
  }

  void reset_accumulated_stats() override {
    LibStats s = lib_stats();
    std::lock_guard<std::mutex> lock(mu_);
    base_ = s;
  }

  void reset_peak_stats() override {
    check(lib_.reset_peak_stats(), "reset_peak_host_memory_stats");
    LibStats s = lib_stats();
    std::lock_guard<std::mutex> lock(mu_);
    blocks_peak_ = static_cast<int64_t>(s.device_allocs) - static_cast<int64_t>(s.device_frees);
    requests_peak_ = static_cast<int64_t>(s.live_allocations);
  }

  void begin_allocate_to_pool(c10::MempoolId_t pool_id, std::function<bool(c10::Stream)> filter) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& capture : captures_) {
      TORCH_CHECK(capture.first != pool_id, "beginAllocateToPool: already recording to mempool_id");
    }
    captures_.emplace_back(pool_id, std::move(filter));
    capturing_.store(true, std::memory_order_relaxed);
  }

  void end_allocate_to_pool(c10::MempoolId_t pool_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(captures_.begin(), captures_.end(), [&](const auto& c) { return c.first == pool_id; });
    TORCH_CHECK(it != captures_.end(), "endAllocatePool: not currently recording to mempool_id");
    captures_.erase(it);
    capturing_.store(!captures_.empty(), std::memory_order_relaxed);
  }

  void release_pool(c10::MempoolId_t /*pool_id*/) override {}

 private:
  // Whether a capture is under way (torch.cuda.graph began one and has not ended it).
  bool capturing() const {
    return capturing_.load(std::memory_order_relaxed);
  }

  // The device named to the first allocation, which makes the pool (later calls name it too).
  int pinning_device() {
    int device = device_.load(std::memory_order_relaxed);
    if (device < 0) {
      auto with_context = c10::cuda::getDeviceIndexWithPrimaryContext();
      device = static_cast<int>(with_context.value_or(c10::cuda::current_device()));
      device_.store(device, std::memory_order_relaxed);
    }
    return device;
  }

  LibStats lib_stats() {
    LibStats s{};
    check(lib_.stats(&s), "host_memory_stats");
    return s;
  }

  void check(int status, const char* what) const {
    TORCH_CHECK(status == OK, "streamalloc: ", what, ": ", lib_.last_error());
  }

  Lib lib_;
  at::HostAllocator* previous_;
  std::atomic<int> device_{-1};
  std::atomic<bool> capturing_{false};
  std::mutex mu_; // what follows
  LibStats base_{}; // the figures at the last reset of the accumulated ones
  int64_t blocks_peak_ = 0;
  int64_t requests_peak_ = 0;
  std::vector<std::pair<c10::MempoolId_t, std::function<bool(c10::Stream)>>> captures_;
};

HostAllocator* g_host = nullptr;

void deleter(void* ctx) {
  if (ctx != nullptr) {
    g_host->free(ctx);
  }
}

} // namespace streamalloc_torch_host

extern "C" {

// Makes the pinned pool of the library `handle` (dlopen'ed by backend.cpp's install) torch's
// CUDA host allocator. Returns 0, or -1 with the reason in `err`. A second call does nothing.
__attribute__((visibility("default"))) int streamalloc_torch_host_install(void* handle, char* err, size_t errlen) {
  using namespace streamalloc_torch_host;
  auto fail = [&](const std::string& message) {
    set_error(err, errlen, message);
    return -1;
  };
  if (g_host != nullptr) {
    return 0;
  }
  try {
    Lib lib;
    std::string missing;
    resolve(handle, "streamalloc_host_alloc", lib.alloc, missing);
    resolve(handle, "streamalloc_host_free", lib.free, missing);
    resolve(handle, "streamalloc_host_record_stream", lib.record_stream, missing);
    resolve(handle, "streamalloc_host_is_live", lib.is_live, missing);
    resolve(handle, "streamalloc_host_release", lib.release, missing);
    resolve(handle, "streamalloc_host_stats", lib.stats, missing);
    resolve(handle, "streamalloc_host_reset_peak_stats", lib.reset_peak_stats, missing);
    resolve(handle, "streamalloc_last_error", lib.last_error, missing);
    if (!missing.empty()) {
      return fail("the library lacks " + missing);
    }
    // Held for the life of the process: pinned tensors may outlive every other static object.
    auto* host = new HostAllocator(lib, at::getHostAllocator(at::kCUDA));
    g_host = host; // before torch can hand out the first block, whose deleter uses it
    at::setHostAllocator(at::kCUDA, host, 1);
    if (at::getHostAllocator(at::kCUDA) != host) {
      g_host = nullptr;
      delete host;
      return fail("torch kept another CUDA host allocator, registered with a higher priority");
    }
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

} // extern "C"
