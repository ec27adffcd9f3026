/* fork() while other threads are inside the library (issue 33: 10 to 17 of 20 children hung,
 * on locks the parent's other threads held at the fork, which nothing in the child unlocks).
 *
 * Threads hammer allocate/use/record/free/stats/release on the simulator while the main thread
 * forks CHILDREN times. Each child calls the library (every call must be refused at once, the
 * fork named in the last error) and exits normally (the library's exit-time cleanup runs); the
 * parent waits for each at most BOUND_S seconds, kills it past that and counts it as hung.
 * Prints "hung H failed F of N" and exits 0 only when both are 0. STREAMALLOC_CONF must say
 * device=sim (tests/fork.rs runs it). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "streamalloc.h"

#define THREADS 4
#define CHILDREN 20
#define BOUND_S 10.0

static atomic_int stop;

static void sleep_us(long us) {
  struct timespec t = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&t, NULL);
}

static atomic_long calls;

static void *hammer(void *arg) {
  (void)arg;
  cudaStream_t s = NULL;
  if (streamalloc_sim_create_stream(0, &s) != STREAMALLOC_OK) {
    fprintf(stderr, "create_stream: %s\n", streamalloc_last_error());
    exit(2);
  }
  for (long n = 1; !atomic_load(&stop); n++) {
    void *p = NULL;
    size_t size = 4096 * (size_t)(1 + n % 7);
    if (streamalloc_allocate(size, 0, s, &p) != STREAMALLOC_OK) continue;
    streamalloc_sim_use(0, p, 4096, s, 1000);
    streamalloc_record_stream(p, NULL);
    streamalloc_deallocate(p);
    streamalloc_stats_t st;
    streamalloc_stats(0, &st);
    if (n % 16 == 0) {
      streamalloc_sim_synchronize(0, s);
      streamalloc_release(0, NULL);
    }
    atomic_fetch_add(&calls, 1);
  }
  return NULL;
}

/* In the child: 0 if every call was refused with the fork named, else 1. */
static int child(void) {
  int bad = 0;
  void *p = NULL;
  streamalloc_status_t s = streamalloc_allocate(4096, 0, NULL, &p);
  if (s == STREAMALLOC_OK || p != NULL || strstr(streamalloc_last_error(), "fork") == NULL) {
    printf("child: allocate: status %d, %s\n", (int)s, streamalloc_last_error());
    bad = 1;
  }
  streamalloc_stats_t st;
  if (streamalloc_stats(0, &st) == STREAMALLOC_OK) bad = 1;
  if (streamalloc_release(0, NULL) == STREAMALLOC_OK) bad = 1;
  if (streamalloc_sim_advance(0, 1) == STREAMALLOC_OK) bad = 1;
  if (streamalloc_configure("device=sim") == STREAMALLOC_OK) bad = 1;
  /* The framework hooks have no status: they must return, with NULL for an allocation. */
  if (streamalloc_malloc(4096, 0, NULL) != NULL) bad = 1;
  streamalloc_free((void *)0x7f0000000000, 4096, 0, NULL);
  streamalloc_cupy_free(NULL, (void *)0x7f0000000000, 0);
  streamalloc_cupy_set_stream_keeper(NULL);
  streamalloc_torch_empty_cache();
  fflush(stdout);
  return bad;
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

int main(void) {
  pthread_t threads[THREADS];
  for (int i = 0; i < THREADS; i++) pthread_create(&threads[i], NULL, hammer, NULL);
  while (atomic_load(&calls) < 100) sleep_us(1000);
  int hung = 0, failed = 0;
  for (int i = 0; i < CHILDREN; i++) {
    sleep_us(2000);
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
      perror("fork");
      return 2;
    }
    if (pid == 0) exit(child()); /* exit(), not _exit(): atexit handlers run */
    int status = 0;
    double deadline = now_s() + BOUND_S;
    pid_t done = 0;
    while ((done = waitpid(pid, &status, WNOHANG)) == 0 && now_s() < deadline) sleep_us(2000);
    if (done == 0) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      hung++;
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed++;
    }
  }
  atomic_store(&stop, 1);
  for (int i = 0; i < THREADS; i++) pthread_join(threads[i], NULL);
  /* The parent goes on. */
  void *p = NULL;
  if (streamalloc_allocate(4096, 0, NULL, &p) != STREAMALLOC_OK || streamalloc_deallocate(p) != STREAMALLOC_OK) {
    printf("parent: %s\n", streamalloc_last_error());
    return 1;
  }
  printf("hung %d failed %d of %d\n", hung, failed, CHILDREN);
  return hung == 0 && failed == 0 ? 0 : 1;
}
