/* The front end's word kept by the library's pointer table (streamalloc_allocate_word,
 * _free_word, _entry, _pool_live, _pool_allocate_at) on the simulator (STREAMALLOC_CONF names
 * device=sim): each free hands back exactly the word, size, stream and private pool of its
 * allocation, from 8 threads on 8 streams freeing one another's allocations too. Prints one
 * line per failed check; exits 0 when all pass, 1 otherwise. With the argument "one-pool"
 * (best_fit), the allocator records the stream asked for on each allocation. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "check.h"

#define THREADS 8
#define ROUNDS 2000
#define LIVE 16

static cudaStream_t streams[THREADS];
/* best_fit: one pool, the default stream's, on which every other stream is recorded. */
static int one_pool;
static pthread_mutex_t check_lock = PTHREAD_MUTEX_INITIALIZER;

#define TCHECK(cond)                     \
  do {                                   \
    pthread_mutex_lock(&check_lock);     \
    CHECK(cond);                         \
    pthread_mutex_unlock(&check_lock);   \
  } while (0)

/* Thread `t` allocates on its stream with words (t, round, slot), frees what it made, and
 * every fourth time frees on its neighbour's stream (a wrong hint: still found). */
static void* worker(void* arg) {
  uint64_t t = (uint64_t)(uintptr_t)arg;
  void* live[LIVE] = {0};
  uint64_t words[LIVE] = {0};
  size_t sizes[LIVE] = {0};
  for (uint64_t r = 0; r < ROUNDS; r++) {
    size_t slot = (size_t)((r * 7 + t) % LIVE);
    if (live[slot]) {
      streamalloc_entry_t e;
      memset(&e, 0xff, sizeof e);
      cudaStream_t hint = r % 4 == 0 ? streams[(t + 1) % THREADS] : streams[t];
      TCHECK(streamalloc_free_word(live[slot], 0, hint, &e) == STREAMALLOC_OK);
      TCHECK(e.word == words[slot] && e.size == sizes[slot] && e.stream == streams[t] && !e.in_pool &&
             e.device == 0 && e.recorded == one_pool);
      live[slot] = NULL;
    }
    sizes[slot] = 256 + (size_t)((r * 1103515245 + t) % (3 << 20));
    words[slot] = (t << 48) | (r << 8) | slot;
    streamalloc_entry_t made;
    TCHECK(streamalloc_allocate_word(sizes[slot], 0, streams[t], words[slot], &live[slot], &made) ==
           STREAMALLOC_OK);
    TCHECK(live[slot] != NULL && made.word == words[slot] && !made.in_pool);
  }
  for (size_t slot = 0; slot < LIVE; slot++) {
    if (live[slot]) {
      streamalloc_entry_t e;
      TCHECK(streamalloc_entry(live[slot], &e) == STREAMALLOC_OK && e.word == words[slot]);
      TCHECK(streamalloc_free_word(live[slot], 0, NULL, &e) == STREAMALLOC_OK && e.word == words[slot]);
    }
  }
  return NULL;
}

int main(int argc, char** argv) {
  one_pool = argc > 1 && strcmp(argv[1], "one-pool") == 0;
  for (int t = 0; t < THREADS; t++) CHECK(streamalloc_sim_create_stream(0, &streams[t]) == STREAMALLOC_OK);

  /* One allocation: its entry, a recorded stream, its free; then it is gone. */
  void* p = NULL;
  streamalloc_entry_t e;
  CHECK(streamalloc_allocate_word(1 << 20, 0, streams[0], 42, &p, &e) == STREAMALLOC_OK);
  CHECK(e.word == 42 && e.size == 1 << 20 && e.stream == streams[0] && !e.in_pool);
  CHECK(streamalloc_entry(p, &e) == STREAMALLOC_OK && e.word == 42 && e.recorded == one_pool);
  CHECK(streamalloc_record_stream(p, streams[1]) == STREAMALLOC_OK);
  CHECK(streamalloc_entry(p, &e) == STREAMALLOC_OK && e.recorded);
  CHECK(streamalloc_free_word(p, 0, streams[0], &e) == STREAMALLOC_OK && e.word == 42 && e.recorded);
  CHECK(streamalloc_free_word(p, 0, streams[0], &e) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(strstr(streamalloc_last_error(), "not a live") != NULL);
  CHECK(streamalloc_entry(p, &e) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(streamalloc_free_word(NULL, 0, NULL, &e) == STREAMALLOC_INVALID_ARGUMENT);

  /* In private pool (3, 4): the library says so at the allocation, the free and the list. */
  void *q = NULL, *r = NULL;
  CHECK(streamalloc_pool_begin(0, 3, 4, NULL, NULL, NULL) == STREAMALLOC_OK);
  CHECK(streamalloc_allocate_word(4096, 0, streams[2], 7, &q, &e) == STREAMALLOC_OK);
  CHECK(e.in_pool && e.pool_hi == 3 && e.pool_lo == 4 && e.word == 7);
  CHECK(streamalloc_allocate_word(8192, 0, streams[2], 8, &r, &e) == STREAMALLOC_OK && e.in_pool);
  CHECK(streamalloc_pool_end(0, 3, 4) == STREAMALLOC_OK);
  size_t n = 0;
  void* ptrs[2] = {0};
  streamalloc_entry_t entries[2];
  CHECK(streamalloc_pool_live(0, 3, 4, NULL, NULL, 0, &n) == STREAMALLOC_INVALID_ARGUMENT && n == 2);
  CHECK(streamalloc_pool_live(0, 3, 4, ptrs, entries, 2, &n) == STREAMALLOC_OK && n == 2);
  CHECK((ptrs[0] == q && entries[0].word == 7 && ptrs[1] == r && entries[1].word == 8) ||
        (ptrs[0] == r && entries[0].word == 8 && ptrs[1] == q && entries[1].word == 7));
  CHECK(streamalloc_pool_live(0, 9, 9, ptrs, entries, 2, &n) == STREAMALLOC_OK && n == 0);
  CHECK(streamalloc_free_word(q, 0, streams[2], &e) == STREAMALLOC_OK);
  CHECK(e.in_pool && e.pool_hi == 3 && e.pool_lo == 4 && e.word == 7 && e.size == 4096);
  CHECK(streamalloc_pool_live(0, 3, 4, ptrs, entries, 2, &n) == STREAMALLOC_OK && n == 1 && ptrs[0] == r);
  /* A checkpoint restored: q's range handed out again, with a new word; r's is not free. */
  CHECK(streamalloc_pool_allocate_at(0, 3, 4, q, 4096, streams[2], 9) == STREAMALLOC_OK);
  CHECK(streamalloc_pool_live(0, 3, 4, ptrs, entries, 2, &n) == STREAMALLOC_OK && n == 2);
  CHECK(streamalloc_pool_allocate_at(0, 3, 4, r, 8192, streams[2], 10) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(strstr(streamalloc_last_error(), "not free memory of private pool") != NULL);
  CHECK(streamalloc_pool_allocate_at(0, 9, 9, q, 4096, streams[2], 10) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(streamalloc_free_word(q, 0, streams[2], &e) == STREAMALLOC_OK && e.word == 9 && e.in_pool);
  CHECK(streamalloc_free_word(r, 0, NULL, &e) == STREAMALLOC_OK && e.word == 8);
  CHECK(streamalloc_pool_release(0, 3, 4) == STREAMALLOC_OK);

  pthread_t threads[THREADS];
  for (int t = 0; t < THREADS; t++) pthread_create(&threads[t], NULL, worker, (void*)(uintptr_t)t);
  for (int t = 0; t < THREADS; t++) pthread_join(threads[t], NULL);
  streamalloc_stats_t s;
  CHECK(streamalloc_stats(0, &s) == STREAMALLOC_OK && s.allocated == 0 && s.live_allocations == 0);
  uint64_t violations = 1;
  CHECK(streamalloc_sim_violations(0, &violations) == STREAMALLOC_OK && violations == 0);
  printf("%d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}
