// The torch backend's hot path before and after issue 48, through libstreamalloc's C ABI on
// whatever STREAMALLOC_CONF says (device=sim: the library's CPU cost alone), from T threads,
// each on a stream of its own, allocating and freeing sizes in turn (16 live per thread):
//   table  the old backend's path: streamalloc_allocate + an insert into one std::unordered_map
//          under one std::mutex (its live_), then an erase under the mutex + streamalloc_free
//          with the allocation's device and stream
//   word   the new path: streamalloc_allocate_word, then streamalloc_free_word hinted with the
//          thread's stream, which hands back what the library kept (no table, no lock here)
// Prints wall-clock ns per allocate+free pair (all threads' pairs together), the best of 5
// runs, per path and thread count.
// Usage: capi_word_bench OPS_PER_THREAD THREADS...
//   g++ -O2 -std=c++17 -pthread lab/capi_word_bench.cpp -Icrates/streamalloc-capi/include \
//     -Ltarget/release -lstreamalloc -Wl,-rpath,$PWD/target/release -o capi_word_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "streamalloc.h"

struct Alloc {
  size_t size;
  int device;
  cudaStream_t stream;
};

static std::mutex table_mu;
static std::unordered_map<void*, Alloc> table;

static void run(bool word, int ops, cudaStream_t stream) {
  static const size_t sizes[] = {512, 4096, 65536, 1 << 20, 3 << 20, 200, 12288, 8 << 20};
  void* live[16] = {};
  for (int i = 0; i < ops; i++) {
    int slot = i % 16;
    if (live[slot] != nullptr) {
      if (word) {
        streamalloc_entry_t e;
        if (streamalloc_free_word(live[slot], 0, stream, &e) != STREAMALLOC_OK) std::abort();
      } else {
        Alloc a;
        {
          std::lock_guard<std::mutex> lock(table_mu);
          auto it = table.find(live[slot]);
          a = it->second;
          table.erase(it);
        }
        streamalloc_free(live[slot], static_cast<ssize_t>(a.size), a.device, a.stream);
      }
    }
    size_t size = sizes[(i * 7 + slot) % 8];
    if (word) {
      streamalloc_entry_t e;
      if (streamalloc_allocate_word(size, 0, stream, 1, &live[slot], &e) != STREAMALLOC_OK) std::abort();
    } else {
      if (streamalloc_allocate(size, 0, stream, &live[slot]) != STREAMALLOC_OK) std::abort();
      std::lock_guard<std::mutex> lock(table_mu);
      table[live[slot]] = Alloc{size, 0, stream};
    }
  }
  for (void* p : live) {
    if (p == nullptr) continue;
    if (word) {
      streamalloc_free_word(p, 0, stream, nullptr);
    } else {
      {
        std::lock_guard<std::mutex> lock(table_mu);
        table.erase(p);
      }
      streamalloc_free(p, 0, 0, stream);
    }
  }
}

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s OPS_PER_THREAD THREADS...\n", argv[0]);
    return 2;
  }
  int ops = std::atoi(argv[1]);
  for (int a = 2; a < argc; a++) {
    int threads = std::atoi(argv[a]);
    std::vector<cudaStream_t> streams(threads);
    for (auto& s : streams) {
      if (streamalloc_sim_create_stream(0, &s) != STREAMALLOC_OK) s = nullptr;
    }
    for (bool word : {false, true}) {
      double best = 1e30;
      for (int rep = 0; rep < 5; rep++) {
        auto t0 = std::chrono::steady_clock::now();
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; t++) pool.emplace_back(run, word, ops, streams[t]);
        for (auto& t : pool) t.join();
        double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, ns / (static_cast<double>(ops) * threads));
      }
      std::printf("%-5s threads=%d  %.1f ns per allocate+free (wall time over all threads' pairs)\n", word ? "word" : "table", threads, best);
    }
  }
  return 0;
}
