/* streamalloc_segments on the simulator (STREAMALLOC_CONF names device=sim): the segments and
 * blocks listed are exactly what the library holds. Live allocations on two streams and in a
 * private pool, a freed block whose reuse waits for a recorded stream, a freed one; then the
 * listing must tile the reserved bytes, show each live allocation as an allocated block of
 * its stream's (or its pool's) segment, the waiting free as pending, and nothing else
 * allocated. With the argument "one-pool" (best_fit) every segment is the default stream's;
 * with "plain" too, and a freed block is gone at once; with "driver-pool" (strategy=async)
 * each live allocation is a segment of one block (the driver places the memory).
 * Prints one line per failed check; exits 0 when all pass, 1 otherwise. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)

typedef struct {
  streamalloc_segment_t* segments;
  streamalloc_block_t* blocks;
  size_t n_segments, n_blocks;
} listing_t;

/* Lists device 0's segments as a front end does: asks the counts, then the arrays. */
static listing_t list(void) {
  listing_t l = {NULL, NULL, 0, 0};
  for (int attempt = 0; attempt < 4; attempt++) {
    size_t ns = 0, nb = 0;
    streamalloc_status_t st = streamalloc_segments(0, l.segments, l.n_segments, l.blocks, l.n_blocks, &ns, &nb);
    if (st == STREAMALLOC_OK) {
      l.n_segments = ns;
      l.n_blocks = nb;
      return l;
    }
    CHECK(st == STREAMALLOC_INVALID_ARGUMENT);
    free(l.segments);
    free(l.blocks);
    l.segments = calloc(ns + 1, sizeof *l.segments);
    l.blocks = calloc(nb + 1, sizeof *l.blocks);
    l.n_segments = ns;
    l.n_blocks = nb;
  }
  CHECK(!"the listing settled");
  return l;
}

/* The block at `p` and its segment; NULL if none starts there. */
static const streamalloc_block_t* block_at(const listing_t* l, void* p, const streamalloc_segment_t** seg) {
  for (size_t i = 0; i < l->n_segments; i++) {
    const streamalloc_segment_t* s = &l->segments[i];
    for (size_t j = s->first_block; j < s->first_block + s->blocks; j++) {
      if (l->blocks[j].addr == (uintptr_t)p) {
        *seg = s;
        return &l->blocks[j];
      }
    }
  }
  return NULL;
}

/* The segments are in address order and apart, each tiled by its blocks, and they add up
 * to the reserved bytes; the free blocks to the cached ones. Returns the allocated blocks. */
static size_t check_tiling(const listing_t* l) {
  streamalloc_stats_t stats;
  CHECK(streamalloc_stats(0, &stats) == STREAMALLOC_OK);
  size_t reserved = 0, free_bytes = 0, allocated = 0, blocks = 0;
  for (size_t i = 0; i < l->n_segments; i++) {
    const streamalloc_segment_t* s = &l->segments[i];
    if (i > 0) CHECK(l->segments[i - 1].addr + l->segments[i - 1].size <= s->addr);
    CHECK(s->first_block == blocks && s->blocks > 0);
    uintptr_t at = s->addr;
    for (size_t j = s->first_block; j < s->first_block + s->blocks && j < l->n_blocks; j++) {
      CHECK(l->blocks[j].addr == at && l->blocks[j].size > 0);
      at += l->blocks[j].size;
      if (l->blocks[j].state == STREAMALLOC_BLOCK_FREE) free_bytes += l->blocks[j].size;
      if (l->blocks[j].state == STREAMALLOC_BLOCK_ALLOCATED) allocated++;
    }
    CHECK(at == s->addr + s->size);
    blocks += s->blocks;
    reserved += s->size;
  }
  CHECK(blocks == l->n_blocks);
  if (reserved != stats.reserved || free_bytes != stats.cached) {
    printf("listed %zu reserved, %zu free; the statistics say %zu reserved, %zu cached\n", reserved, free_bytes,
           stats.reserved, stats.cached);
  }
  CHECK(reserved == stats.reserved);
  CHECK(free_bytes == stats.cached);
  return allocated;
}

int main(int argc, char** argv) {
  int driver_pool = argc > 1 && strcmp(argv[1], "driver-pool") == 0;
  /* One pool for every stream (best_fit, plain): its segments are the default stream's. */
  int plain = argc > 1 && strcmp(argv[1], "plain") == 0;
  int one_pool = plain || (argc > 1 && strcmp(argv[1], "one-pool") == 0);
  cudaStream_t s1 = NULL, s2 = NULL;
  CHECK(streamalloc_sim_create_stream(0, &s1) == STREAMALLOC_OK);
  CHECK(streamalloc_sim_create_stream(0, &s2) == STREAMALLOC_OK);
  void *a = NULL, *b = NULL, *c = NULL, *d = NULL, *e = NULL, *f = NULL;
  CHECK(streamalloc_allocate(1 * MIB, 0, s1, &a) == STREAMALLOC_OK);
  if (driver_pool) {
    CHECK(streamalloc_allocate(3 * MIB + 5, 0, s2, &b) == STREAMALLOC_OK);
    listing_t l = list();
    CHECK(l.n_segments == 2 && l.n_blocks == 2);
    const streamalloc_segment_t* seg = NULL;
    const streamalloc_block_t* blk = block_at(&l, b, &seg);
    CHECK(blk != NULL && blk->size == 3 * MIB + 5 && blk->state == STREAMALLOC_BLOCK_ALLOCATED);
    CHECK(seg != NULL && seg->addr == (uintptr_t)b && seg->size == 3 * MIB + 5 && seg->stream == s2);
    blk = block_at(&l, a, &seg);
    CHECK(blk != NULL && blk->size == 1 * MIB && seg->stream == s1);
    free(l.segments);
    free(l.blocks);
    CHECK(streamalloc_deallocate(a) == STREAMALLOC_OK);
    CHECK(streamalloc_deallocate(b) == STREAMALLOC_OK);
    l = list();
    CHECK(l.n_segments == 0);
    printf("%d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
  }
  CHECK(streamalloc_allocate(3 * MIB, 0, s1, &b) == STREAMALLOC_OK);
  CHECK(streamalloc_allocate(300 * KIB, 0, s2, &c) == STREAMALLOC_OK);
  CHECK(streamalloc_allocate(8 * MIB, 0, s2, &d) == STREAMALLOC_OK);
  CHECK(streamalloc_deallocate(b) == STREAMALLOC_OK);
  CHECK(streamalloc_allocate(2 * MIB, 0, s1, &e) == STREAMALLOC_OK);
  /* c is used by a long kernel on s1 and freed: its reuse waits for that kernel. */
  CHECK(streamalloc_sim_use(0, c, 300 * KIB, s1, 1000000000) == STREAMALLOC_OK);
  CHECK(streamalloc_record_stream(c, s1) == STREAMALLOC_OK);
  CHECK(streamalloc_deallocate(c) == STREAMALLOC_OK);
  /* f in private pool (1, 2). */
  CHECK(streamalloc_pool_begin(0, 1, 2, NULL, NULL, NULL) == STREAMALLOC_OK);
  CHECK(streamalloc_allocate(5 * MIB, 0, s1, &f) == STREAMALLOC_OK);
  CHECK(streamalloc_pool_end(0, 1, 2) == STREAMALLOC_OK);

  size_t ns = 0, nb = 0;
  CHECK(streamalloc_segments(0, NULL, 0, NULL, 0, NULL, &nb) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(streamalloc_segments(0, NULL, 0, NULL, 0, &ns, &nb) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(ns > 0 && nb >= ns);
  CHECK(streamalloc_segments(1, NULL, 0, NULL, 0, &ns, &nb) == STREAMALLOC_OK && ns == 0 && nb == 0);

  listing_t l = list();
  CHECK(check_tiling(&l) == 4);
  struct {
    void* p;
    size_t size;
    cudaStream_t stream;
    int in_pool;
  } live[] = {{a, 1 * MIB, s1, 0}, {d, 8 * MIB, s2, 0}, {e, 2 * MIB, s1, 0}, {f, 5 * MIB, s1, 1}};
  for (size_t i = 0; i < sizeof live / sizeof live[0]; i++) {
    const streamalloc_segment_t* seg = NULL;
    const streamalloc_block_t* blk = block_at(&l, live[i].p, &seg);
    CHECK(blk != NULL);
    if (blk == NULL) continue;
    CHECK(blk->state == STREAMALLOC_BLOCK_ALLOCATED && blk->size >= live[i].size);
    CHECK(seg->in_pool == live[i].in_pool);
    if (live[i].in_pool) {
      CHECK(seg->pool_hi == 1 && seg->pool_lo == 2);
    } else {
      CHECK(seg->stream == (one_pool ? NULL : live[i].stream) && seg->pool_hi == 0 && seg->pool_lo == 0);
    }
  }
  const streamalloc_segment_t* seg = NULL;
  const streamalloc_block_t* waiting = block_at(&l, c, &seg);
  if (plain) { /* caches nothing: the memory went back at the free (the driver orders it) */
    CHECK(waiting == NULL);
  } else {
    CHECK(waiting != NULL && waiting->state == STREAMALLOC_BLOCK_PENDING);
    CHECK(seg != NULL && seg->stream == (one_pool ? NULL : s2));
  }
  free(l.segments);
  free(l.blocks);

  /* Everything freed and released: nothing listed. */
  CHECK(streamalloc_deallocate(a) == STREAMALLOC_OK);
  CHECK(streamalloc_deallocate(d) == STREAMALLOC_OK);
  CHECK(streamalloc_deallocate(e) == STREAMALLOC_OK);
  CHECK(streamalloc_deallocate(f) == STREAMALLOC_OK);
  CHECK(streamalloc_pool_release(0, 1, 2) == STREAMALLOC_OK);
  CHECK(streamalloc_sim_synchronize(0, s1) == STREAMALLOC_OK);
  CHECK(streamalloc_release(0, NULL) == STREAMALLOC_OK);
  l = list();
  CHECK(check_tiling(&l) == 0);
  CHECK(l.n_segments == 0);
  free(l.segments);
  free(l.blocks);
  printf("%d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}
