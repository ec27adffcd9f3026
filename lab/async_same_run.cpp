// AsyncPool through the C ABI against raw cudaMallocAsync in one process, passes alternating,
// so that every subject sees the same default pool and the same moment of the machine
// (separate processes on the H200 differ by up to 2x from one run to the next). Each round
// replays the trace once through every subject, in an order rotated from round to round, with
// the anchors' replay loop: one stream per trace stream, what is left live freed at the end of
// the pass, then cudaDeviceSynchronize. Prints one JSON line per round and per subject a
// summary line: its median pass and the median, quartiles and count under 1.1 of its
// per-round ratio to the first subject. Subjects:
//   async          raw cudaMallocAsync + cudaFreeAsync, the anchors' lambdas
//   pool           cuMemAllocFromPoolAsync on the default pool + cuMemFreeAsync: the driver calls
//                  AsyncPool makes (outside its own captures)
//   pool_ctx       the same, each call preceded by cuCtxGetCurrent (a bind of the device layer)
//   pool_ctx_query the same plus cuCtxGetCurrent + cuStreamIsCapturing before each call: what
//                  AsyncPool made up to run 22 (a capture query per call, every call bound)
//   so:LIB         streamalloc_malloc / streamalloc_free of LIB (STREAMALLOC_CONF chooses the
//                  strategy); a second so: subject with another LIB compares two builds
// Built and run by lab/run `samerun`.
//   usage: async_same_run TRACE ROUNDS SUBJECT...
#include <dlfcn.h>
#include <algorithm>
#include <cstdint>
#include <thread>
#include <cuda.h>
#include "replay_common.h"

struct Subject { std::string name; AllocFn alloc; FreeFn free; std::vector<double> ns; };

static double pass(const Trace& t, const std::vector<cudaStream_t>& streams, Subject& s) {
  std::vector<void*> ptr(t.slots, nullptr);
  auto t0 = std::chrono::steady_clock::now();
  for (const Op& o : t.ops) {
    if (o.kind == 0) {
      ptr[o.slot] = s.alloc(o.size, streams[o.stream]);
      if (!ptr[o.slot]) { fprintf(stderr, "%s: allocation of %zu failed\n", s.name.c_str(), o.size); exit(1); }
    } else { s.free(ptr[o.slot], o.size, streams[o.stream]); ptr[o.slot] = nullptr; }
  }
  for (int i = 0; i < t.slots; i++) if (ptr[i]) { s.free(ptr[i], 0, streams[0]); ptr[i] = nullptr; }
  cudaDeviceSynchronize();
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / t.ops.size();
}

static double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[(size_t)(q * (v.size() - 1) + 0.5)];
}

static CUstream cu(cudaStream_t s) { return (CUstream)s; }
static void ctx() { CUcontext c; cuCtxGetCurrent(&c); }

int main(int argc, char** argv) {
  if (argc < 4) { fprintf(stderr, "usage: async_same_run TRACE ROUNDS SUBJECT...\n"); return 2; }
  int rounds = atoi(argv[2]);
  cudaFree(0);
  cudaMemPool_t rt_pool; cudaDeviceGetDefaultMemPool(&rt_pool, 0);
  uint64_t thr = UINT64_MAX; cudaMemPoolSetAttribute(rt_pool, cudaMemPoolAttrReleaseThreshold, &thr);
  CUmemoryPool pool = (CUmemoryPool)rt_pool;
  std::vector<Subject> subjects;
  for (int i = 3; i < argc; i++) {
    std::string m = argv[i];
    if (m == "async") {
      subjects.push_back({m, [](size_t n, cudaStream_t s) { void* p = nullptr; cudaMallocAsync(&p, n, s); return p; },
                          [](void* p, size_t, cudaStream_t s) { cudaFreeAsync(p, s); }, {}});
    } else if (m == "pool" || m == "pool_ctx" || m == "pool_ctx_query") {
      bool c = m != "pool", q = m == "pool_ctx_query";
      subjects.push_back({m, [=](size_t n, cudaStream_t s) {
                             if (q) { ctx(); CUstreamCaptureStatus st; cuStreamIsCapturing(cu(s), &st); }
                             if (c) ctx();
                             CUdeviceptr p = 0; cuMemAllocFromPoolAsync(&p, n, pool, cu(s)); return (void*)p; },
                          [=](void* p, size_t, cudaStream_t s) {
                             if (q) { ctx(); CUstreamCaptureStatus st; cuStreamIsCapturing(cu(s), &st); }
                             if (c) ctx();
                             cuMemFreeAsync((CUdeviceptr)p, cu(s)); }, {}});
    } else if (m.rfind("so:", 0) == 0) {
      void* h = dlopen(m.c_str() + 3, RTLD_NOW | RTLD_LOCAL);
      if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
      auto af = (void* (*)(ssize_t, int, cudaStream_t))dlsym(h, "streamalloc_malloc");
      auto ff = (void (*)(void*, ssize_t, int, cudaStream_t))dlsym(h, "streamalloc_free");
      if (!af || !ff) { fprintf(stderr, "%s: missing symbols\n", m.c_str()); return 1; }
      subjects.push_back({m, [af](size_t n, cudaStream_t s) { return af((ssize_t)n, 0, s); },
                          [ff](void* p, size_t n, cudaStream_t s) { ff(p, (ssize_t)n, 0, s); }, {}});
    } else { fprintf(stderr, "unknown subject %s\n", m.c_str()); return 2; }
  }
  Trace t = load_trace(argv[1]);
  std::vector<cudaStream_t> streams(t.streams);
  for (auto& s : streams) cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const char* tn = strrchr(argv[1], '/'); tn = tn ? tn + 1 : argv[1];
  // Whether AsyncPool's driver calls work on a thread with no current context, given explicit
  // stream and pool handles (the device layer makes them without binding one: device/cuda.rs).
  std::thread([&] {
    CUcontext c = nullptr; cuCtxGetCurrent(&c);
    CUstreamCaptureStatus st; CUdeviceptr p = 0;
    int q = cuStreamIsCapturing(cu(streams[0]), &st), a = cuMemAllocFromPoolAsync(&p, 1 << 20, pool, cu(streams[0]));
    int f = p ? cuMemFreeAsync(p, cu(streams[0])) : -1;
    printf("{\"probe\":\"no current context\",\"context_was_null\":%d,\"is_capturing\":%d,\"alloc_from_pool\":%d,\"free\":%d}\n",
           c == nullptr, q, a, f);
  }).join();
  for (auto& s : subjects) pass(t, streams, s);  // warm-up: pools grown, code paged in
  std::vector<std::vector<double>> ratio(subjects.size());
  for (int r = 0; r < rounds; r++) {
    for (size_t k = 0; k < subjects.size(); k++) {
      Subject& s = subjects[(k + r) % subjects.size()];
      s.ns.push_back(pass(t, streams, s));
    }
    printf("{\"trace\":\"%s\",\"round\":%d", tn, r + 1);
    for (size_t k = 0; k < subjects.size(); k++) {
      ratio[k].push_back(subjects[k].ns.back() / subjects[0].ns.back());
      printf(",\"%s\":%.1f", subjects[k].name.c_str(), subjects[k].ns.back());
    }
    printf("}\n");
  }
  for (size_t k = 0; k < subjects.size(); k++) {
    int under = 0; for (double x : ratio[k]) under += x <= 1.1;
    printf("{\"summary\":true,\"trace\":\"%s\",\"subject\":\"%s\",\"conf\":\"%s\",\"rounds\":%d,\"median_ns\":%.1f,"
           "\"ratio_median\":%.3f,\"ratio_q1\":%.3f,\"ratio_q3\":%.3f,\"rounds_within_1_1\":%d}\n",
           tn, subjects[k].name.c_str(), getenv("STREAMALLOC_CONF") ? getenv("STREAMALLOC_CONF") : "", rounds,
           quantile(subjects[k].ns, 0.5), quantile(ratio[k], 0.5), quantile(ratio[k], 0.25), quantile(ratio[k], 0.75), under);
  }
  return 0;
}
