/* Exercises the C API and the PyTorch and CuPy ABIs of libstreamalloc.so on the device that
 * STREAMALLOC_CONF names (device=sim in CI). Prints one line per failed check and a summary;
 * exits 0 when all pass, 77 when the configured strategy is not built in, 1 otherwise. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

static streamalloc_stats_t stats(void) {
  streamalloc_stats_t s;
  memset(&s, 0xff, sizeof s);
  CHECK(streamalloc_stats(0, &s) == STREAMALLOC_OK);
  return s;
}

enum { THREADS = 4, PAIRS = 20000 };

static void* churn(void* arg) {
  (void)arg;
  for (int i = 0; i < PAIRS; i++) {
    void* p = streamalloc_malloc(512 + (i % 7) * 256, 0, NULL);
    if (!p) return (void*)1;
    streamalloc_free(p, 0, 0, NULL);
  }
  return NULL;
}

int main(void) {
  const char* conf = getenv("STREAMALLOC_CONF");
  if (!conf) {
    printf("set STREAMALLOC_CONF, e.g. device=sim,strategy=plain\n");
    return 1;
  }
  /* Before first use: the same configuration as the environment's is accepted. */
  CHECK(streamalloc_configure(conf) == STREAMALLOC_OK);
  CHECK(strcmp(streamalloc_last_error(), "") == 0);

  void* p = NULL;
  streamalloc_status_t st = streamalloc_allocate(1000, 0, NULL, &p);
  if (st == STREAMALLOC_UNSUPPORTED) {
    printf("skipped: %s\n", streamalloc_last_error());
    return 77;
  }

  /* C API */
  CHECK(st == STREAMALLOC_OK && p != NULL);
  CHECK(((uintptr_t)p % 256) == 0);
  CHECK(stats().allocated == 1000);
  CHECK(stats().live_allocations == 1);
  CHECK(streamalloc_record_stream(p, NULL) == STREAMALLOC_OK);
  CHECK(streamalloc_deallocate(p) == STREAMALLOC_OK);
  CHECK(stats().allocated == 0);
  CHECK(streamalloc_deallocate(p) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(strstr(streamalloc_last_error(), "not a live streamalloc allocation") != NULL);
  CHECK(streamalloc_record_stream(p, NULL) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(streamalloc_deallocate(NULL) == STREAMALLOC_OK);
  CHECK(streamalloc_record_stream(NULL, NULL) == STREAMALLOC_OK);

  p = (void*)1;
  CHECK(streamalloc_allocate(0, 0, NULL, &p) == STREAMALLOC_OK && p == NULL);
  CHECK(streamalloc_allocate(64, 0, NULL, NULL) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(streamalloc_allocate(64, -1, NULL, &p) == STREAMALLOC_INVALID_ARGUMENT && p == NULL);
  CHECK(strstr(streamalloc_last_error(), "device -1") != NULL);
  CHECK(streamalloc_allocate(64, 1000, NULL, &p) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(streamalloc_allocate(SIZE_MAX, 0, NULL, &p) == STREAMALLOC_INVALID_ARGUMENT && p == NULL);
  st = streamalloc_allocate((size_t)1 << 60, 0, NULL, &p);
  CHECK(st == STREAMALLOC_OUT_OF_MEMORY && p == NULL);
  CHECK(strstr(streamalloc_last_error(), "out of memory") != NULL);
  CHECK(stats().failures >= 1);

  size_t released = 12345;
  CHECK(streamalloc_release(0, &released) == STREAMALLOC_OK && released != 12345);
  CHECK(streamalloc_release(0, NULL) == STREAMALLOC_OK);
  CHECK(streamalloc_release(7, &released) == STREAMALLOC_OK && released == 0);
  CHECK(streamalloc_release(-3, &released) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(streamalloc_stats(0, NULL) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(streamalloc_stats(64, &(streamalloc_stats_t){0}) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(streamalloc_stats(5, &(streamalloc_stats_t){0}) == STREAMALLOC_OK);

  /* Configuration after first use: only an equal one is accepted. */
  CHECK(streamalloc_configure(conf) == STREAMALLOC_OK);
  CHECK(streamalloc_configure("device=sim,strategy=plain,stats=true,limit=1GiB") ==
        STREAMALLOC_CONFIG_ERROR);
  CHECK(strstr(streamalloc_last_error(), "already configured") != NULL);
  CHECK(streamalloc_configure("colour=blue") == STREAMALLOC_CONFIG_ERROR);
  CHECK(streamalloc_configure(NULL) == STREAMALLOC_INVALID_ARGUMENT);

  /* PyTorch CUDAPluggableAllocator ABI */
  void* t = streamalloc_malloc(1 << 20, 0, NULL);
  CHECK(t != NULL);
  CHECK(stats().allocated == 1 << 20);
  streamalloc_free(t, 1 << 20, 0, NULL);
  CHECK(stats().allocated == 0);
  CHECK(streamalloc_malloc(0, 0, NULL) == NULL);
  CHECK(streamalloc_malloc(-5, 0, NULL) == NULL);
  CHECK(strstr(streamalloc_last_error(), "negative size -5") != NULL);
  CHECK(streamalloc_malloc(64, 1000, NULL) == NULL);
  streamalloc_free(t, 1 << 20, 0, NULL); /* double free: reported, not fatal */
  CHECK(strstr(streamalloc_last_error(), "not a live") != NULL);
  /* One map serves every face: a PyTorch pointer freed through the C API. */
  t = streamalloc_malloc(4096, 0, NULL);
  CHECK(streamalloc_deallocate(t) == STREAMALLOC_OK);

  /* CuPy CFunctionAllocator ABI */
  void* c = streamalloc_cupy_malloc(NULL, 3000, 0);
  CHECK(c != NULL);
  CHECK(stats().allocated == 3000);
  streamalloc_cupy_free(NULL, c, 0);
  CHECK(stats().allocated == 0);
  CHECK(streamalloc_cupy_malloc(NULL, 64, -1) == NULL);
  CHECK(streamalloc_cupy_malloc(NULL, SIZE_MAX, 0) == NULL);

  /* Threads: malloc/free pairs through the PyTorch ABI. */
  uint64_t before = stats().total_allocations;
  pthread_t th[THREADS];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < THREADS; i++) pthread_create(&th[i], NULL, churn, NULL);
  for (int i = 0; i < THREADS; i++) {
    void* r;
    pthread_join(th[i], &r);
    CHECK(r == NULL);
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  streamalloc_stats_t s = stats();
  CHECK(s.total_allocations - before == (uint64_t)THREADS * PAIRS);
  CHECK(s.live_allocations == 0 && s.allocated == 0);
  double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
  printf("threads: %d x %d malloc+free pairs, %.0f ns per pair per thread\n", THREADS, PAIRS,
         ns / PAIRS);

  printf("smoke: %d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}
