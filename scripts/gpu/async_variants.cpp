// Where AsyncPool's cost over raw cudaMallocAsync comes from, on the anchors' replay loop:
// the same trace through cudaMallocAsync, through cudaMallocFromPoolAsync on the device's
// default pool (the call AsyncPool makes), and through that plus a capture-status query on
// every allocate and free (what AsyncPool also does). Built and run by device-run.sh `asyncx`.
#include <cstdint>
#include "replay_common.h"
int main(int argc, char** argv) {
  if (argc < 3) { fprintf(stderr, "usage: async_variants async|frompool|frompool_query TRACE\n"); return 2; }
  std::string m = argv[1];
  cudaFree(0);
  cudaMemPool_t pool; cudaDeviceGetDefaultMemPool(&pool, 0);
  uint64_t thr = UINT64_MAX; cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &thr);
  if (m == "async") {
    replay("cudaMallocAsync", argv[2], [](size_t n, cudaStream_t s) { void* p = nullptr; cudaMallocAsync(&p, n, s); return p; },
           [](void* p, size_t, cudaStream_t s) { cudaFreeAsync(p, s); });
  } else if (m == "frompool") {
    replay("cudaMallocFromPoolAsync", argv[2], [pool](size_t n, cudaStream_t s) { void* p = nullptr; cudaMallocFromPoolAsync(&p, n, pool, s); return p; },
           [](void* p, size_t, cudaStream_t s) { cudaFreeAsync(p, s); });
  } else if (m == "frompool_query") {
    replay("cudaMallocFromPoolAsync+query", argv[2], [pool](size_t n, cudaStream_t s) {
             cudaStreamCaptureStatus st; cudaStreamIsCapturing(s, &st);
             void* p = nullptr; cudaMallocFromPoolAsync(&p, n, pool, s); return p; },
           [](void* p, size_t, cudaStream_t s) { cudaStreamCaptureStatus st; cudaStreamIsCapturing(s, &st); cudaFreeAsync(p, s); });
  }
  return 0;
}
