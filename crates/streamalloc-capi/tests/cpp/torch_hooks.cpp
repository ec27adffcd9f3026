// Calls every PyTorch hook of libstreamalloc.so the way torch does: through a pointer of the
// type torch casts the hook's address to (torch/csrc/cuda/Module.cpp), with torch's own
// argument types (a std::pair pool id, a std::function filter passed by value). Runs on the
// simulator under the strategy STREAMALLOC_CONF names; prints "N passed, M failed".
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "streamalloc.h"

using MempoolId = std::pair<unsigned long long, unsigned long long>;
using AllocFn = void* (*)(size_t, int, cudaStream_t);
using FreeFn = void (*)(void*, size_t, int, cudaStream_t);
using RecordStreamFn = void (*)(void*, cudaStream_t);
using BeginFn = void (*)(int, MempoolId, std::function<bool(cudaStream_t)>);
using PoolFn = void (*)(int, MempoolId);
using BaseAllocFn = void* (*)(void*, size_t*);
using ResetFn = void (*)();
using FractionFn = void (*)(double, int);
using InitFn = void (*)(int);

template <typename T>
T hook(T, void* address) {
  return reinterpret_cast<T>(address);
}

static int passed = 0, failed = 0;

static void check(bool ok, const char* what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAILED: %s (last error: %s)\n", what, streamalloc_last_error());
  }
}

// The message of what `f` throws, or "" if it returns.
template <typename F>
static std::string thrown(F f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

int main() {
  auto alloc = hook(AllocFn{}, reinterpret_cast<void*>(&streamalloc_torch_malloc));
  auto free_ = hook(FreeFn{}, reinterpret_cast<void*>(&streamalloc_free));
  auto record = hook(RecordStreamFn{}, reinterpret_cast<void*>(&streamalloc_torch_record_stream));
  auto begin = hook(BeginFn{}, reinterpret_cast<void*>(&streamalloc_torch_begin_allocate_to_pool));
  auto end = hook(PoolFn{}, reinterpret_cast<void*>(&streamalloc_torch_end_allocate_to_pool));
  auto release = hook(PoolFn{}, reinterpret_cast<void*>(&streamalloc_torch_release_pool));
  auto base_alloc = hook(BaseAllocFn{}, reinterpret_cast<void*>(&streamalloc_torch_base_allocation));
  auto empty_cache = hook(ResetFn{}, reinterpret_cast<void*>(&streamalloc_torch_empty_cache));
  auto fraction = hook(FractionFn{}, reinterpret_cast<void*>(&streamalloc_torch_set_memory_fraction));
  auto init = hook(InitFn{}, reinterpret_cast<void*>(&streamalloc_torch_init));
  const size_t mib = 1 << 20;

  init(1);
  void* eager = alloc(mib, 0, nullptr);
  check(eager != nullptr, "an eager allocation");
  record(eager, nullptr);

  // A graph capture: torch's filter, with state the library must keep alive and destroy.
  auto calls = std::make_shared<int>(0);
  {
    std::function<bool(cudaStream_t)> filter = [calls](cudaStream_t) { return ++*calls > 0; };
    begin(0, MempoolId{0, 1}, filter);
  }
  check(calls.use_count() == 2, "the library keeps its own copy of the filter");
  void* g1 = alloc(mib, 0, nullptr);
  check(*calls == 1, "the filter is asked about an allocation");
  check(g1 != nullptr && g1 != eager, "a captured allocation");
  free_(g1, mib, 0, nullptr);
  void* g2 = alloc(mib, 0, nullptr);
  check(g2 == g1, "a block freed in the capture serves the capture again");
  void* out = alloc(4096, 0, nullptr);  // the graph's output, alive after the capture
  end(0, MempoolId{0, 1});
  check(calls.use_count() == 1, "the filter is destroyed when the capture ends");
  free_(g2, mib, 0, nullptr);
  void* after = alloc(mib, 0, nullptr);
  check(after != g1, "memory of the graph's pool is not handed to eager work");
  free_(out, 4096, 0, nullptr);  // returns to the graph's pool

  // A second capture into the same pool reuses its memory.
  begin(0, MempoolId{0, 1}, [](cudaStream_t) { return true; });
  void* g3 = alloc(mib, 0, nullptr);
  check(g3 == g1, "graphs sharing a pool share its memory");
  free_(g3, mib, 0, nullptr);
  end(0, MempoolId{0, 1});
  streamalloc_stats_t before;
  streamalloc_stats(0, &before);
  release(0, MempoolId{0, 1});
  release(0, MempoolId{0, 1});
  streamalloc_stats_t released;
  streamalloc_stats(0, &released);
  check(released.reserved < before.reserved, "a released pool returns its memory");

  // A filter that matches nothing leaves allocations to the main stack.
  begin(0, MempoolId{0, 2}, [](cudaStream_t) { return false; });
  void* eager2 = alloc(mib, 0, nullptr);
  end(0, MempoolId{0, 2});
  release(0, MempoolId{0, 2});
  free_(eager2, mib, 0, nullptr);

  size_t size = 0;
  void* base = base_alloc(after, &size);
  check(base != nullptr && base <= after && static_cast<char*>(after) + mib <= static_cast<char*>(base) + size,
        "base_alloc finds the device allocation holding a block");
  free_(after, mib, 0, nullptr);
  free_(eager, mib, 0, nullptr);

  std::string oom = thrown([&] { alloc(size_t{1} << 50, 0, nullptr); });
  check(oom.rfind("CUDA out of memory (streamalloc): ", 0) == 0, "out of memory throws torch's message");
  empty_cache();
  streamalloc_stats_t emptied;
  streamalloc_stats(0, &emptied);
  check(emptied.reserved == 0 && emptied.allocated == 0, "empty_cache returns the cache");

  fraction(0.01, 0);
  std::string limited = thrown([&] { alloc(size_t{1} << 30, 0, nullptr); });
  check(limited.rfind("CUDA out of memory (streamalloc): ", 0) == 0, "the memory fraction is enforced");
  void* small = alloc(mib, 0, nullptr);
  check(small != nullptr, "a small allocation under the fraction works");
  free_(small, mib, 0, nullptr);
  std::string negative = thrown([&] { alloc(static_cast<size_t>(-5), 0, nullptr); });
  check(negative.find("negative size") != std::string::npos, "a negative size throws");

  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
