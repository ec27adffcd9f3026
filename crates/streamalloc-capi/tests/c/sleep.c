/* Tags, sleep and wake through the C API on the simulator (STREAMALLOC_CONF names device=sim).
 * With the argument "unsupported" (a configuration that cannot sleep), checks that sleep, wake
 * and the tag's figures say so and that tagged allocations are served all the same. Prints one
 * line per failed check; exits 0 when all pass, 1 otherwise. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"

#define MIB ((size_t)1 << 20)

/* Allocates `size` bytes on `stream` under `tag` (NULL: untagged); NULL on failure. */
static void* tagged(const char* tag, size_t size, cudaStream_t stream, streamalloc_status_t* status) {
  void* p = NULL;
  if (tag) CHECK(streamalloc_tag_push(tag) == STREAMALLOC_OK);
  *status = streamalloc_allocate(size, 0, stream, &p);
  if (tag) CHECK(streamalloc_tag_pop() == STREAMALLOC_OK);
  return p;
}

int main(int argc, char** argv) {
  int unsupported = argc > 1 && strcmp(argv[1], "unsupported") == 0;
  const char* kv[] = {"kv_cache"};
  const char* both[] = {"kv_cache", "weights"};
  const char* with_null[] = {"kv_cache", NULL};
  cudaStream_t s = NULL, busy = NULL;
  streamalloc_status_t st;
  streamalloc_stats_t before, after;
  streamalloc_tag_stats_t t;
  uint64_t violations = 1;
  CHECK(streamalloc_sim_create_stream(0, &s) == STREAMALLOC_OK);
  CHECK(streamalloc_sim_create_stream(0, &busy) == STREAMALLOC_OK);
  CHECK(streamalloc_tag_pop() == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(streamalloc_tag_push(NULL) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(streamalloc_tag_push("") == STREAMALLOC_INVALID_ARGUMENT);

  void* a = tagged("kv_cache", 8 * MIB, s, &st);
  CHECK(st == STREAMALLOC_OK && a != NULL);
  void* w = tagged("weights", 4 * MIB, s, &st);
  CHECK(st == STREAMALLOC_OK && w != NULL);
  void* u = tagged(NULL, 8 * MIB, busy, &st);
  CHECK(st == STREAMALLOC_OK && u != NULL);

  if (unsupported) {
    CHECK(streamalloc_sleep(0, kv, 1, 1) == STREAMALLOC_UNSUPPORTED);
    CHECK(strstr(streamalloc_last_error(), "tags do not sleep here") != NULL);
    CHECK(streamalloc_wake(0, kv, 1) == STREAMALLOC_UNSUPPORTED);
    CHECK(streamalloc_tag_stats(0, "kv_cache", &t) == STREAMALLOC_UNSUPPORTED);
  } else {
    CHECK(streamalloc_sim_use(0, a, 8 * MIB, s, 1000000) == STREAMALLOC_OK);
    CHECK(streamalloc_sim_use(0, u, 8 * MIB, busy, 1000000000) == STREAMALLOC_OK);
    CHECK(streamalloc_stats(0, &before) == STREAMALLOC_OK);
    CHECK(streamalloc_sleep(0, both, 2, 1) == STREAMALLOC_OK);
    CHECK(streamalloc_stats(0, &after) == STREAMALLOC_OK);
    CHECK(before.reserved - after.reserved >= 12 * MIB);
    CHECK(streamalloc_tag_stats(0, "kv_cache", &t) == STREAMALLOC_OK);
    CHECK(t.asleep == 1 && t.offloaded == 1 && t.slept >= 8 * MIB && t.stats.reserved == 0);
    CHECK(t.stats.live_allocations == 1);
    /* Allocating in a sleeping tag: an error naming it; other tags go on. */
    CHECK(tagged("kv_cache", MIB, s, &st) == NULL && st == STREAMALLOC_INVALID_ARGUMENT);
    CHECK(strstr(streamalloc_last_error(), "kv_cache") != NULL);
    void* o = tagged("other", MIB, s, &st);
    CHECK(st == STREAMALLOC_OK && o != NULL);
    CHECK(streamalloc_deallocate(o) == STREAMALLOC_OK);
    /* Freeing a sleeping tag's allocation, sleeping again, releasing: each allowed. */
    CHECK(streamalloc_deallocate(w) == STREAMALLOC_OK);
    w = NULL;
    CHECK(streamalloc_sleep(0, kv, 1, 0) == STREAMALLOC_OK);
    CHECK(streamalloc_release(0, NULL) == STREAMALLOC_OK);
    CHECK(streamalloc_wake(0, both, 2) == STREAMALLOC_OK);
    CHECK(streamalloc_wake(0, both, 2) == STREAMALLOC_OK);
    CHECK(streamalloc_tag_stats(0, "kv_cache", &t) == STREAMALLOC_OK);
    CHECK(t.asleep == 0 && t.slept == 0 && t.stats.reserved >= 8 * MIB);
    /* The pinned memory the offload copied into: in the host figures, kept by the device's
     * release (the next offload pins nothing), given back by the host's. */
    streamalloc_stats_t pinned, kept;
    size_t released = 0;
    CHECK(streamalloc_host_stats(&pinned) == STREAMALLOC_OK);
    CHECK(pinned.reserved >= 12 * MIB && pinned.allocated == 0 && pinned.device_allocs > 0);
    CHECK(streamalloc_release(0, NULL) == STREAMALLOC_OK);
    CHECK(streamalloc_host_stats(&kept) == STREAMALLOC_OK && kept.reserved == pinned.reserved);
    CHECK(streamalloc_host_release(&released) == STREAMALLOC_OK && released == pinned.reserved);
    CHECK(streamalloc_host_stats(&kept) == STREAMALLOC_OK && kept.reserved == 0);
    void* b = tagged("kv_cache", MIB, s, &st);
    CHECK(st == STREAMALLOC_OK && b != NULL);
    CHECK(streamalloc_deallocate(b) == STREAMALLOC_OK);
    /* Bad arguments. */
    CHECK(streamalloc_sleep(0, NULL, 1, 0) == STREAMALLOC_INVALID_ARGUMENT);
    CHECK(streamalloc_sleep(0, NULL, 0, 0) == STREAMALLOC_OK);
    CHECK(streamalloc_sleep(0, with_null, 2, 0) == STREAMALLOC_INVALID_ARGUMENT);
    CHECK(streamalloc_wake(0, with_null, 2) == STREAMALLOC_INVALID_ARGUMENT);
    CHECK(streamalloc_sleep(64, kv, 1, 0) == STREAMALLOC_INVALID_ARGUMENT);
    CHECK(streamalloc_tag_stats(0, "kv_cache", NULL) == STREAMALLOC_INVALID_ARGUMENT);
    CHECK(streamalloc_tag_stats(0, NULL, &t) == STREAMALLOC_INVALID_ARGUMENT);
  }
  CHECK(streamalloc_deallocate(a) == STREAMALLOC_OK);
  CHECK(streamalloc_deallocate(w) == STREAMALLOC_OK);
  CHECK(streamalloc_deallocate(u) == STREAMALLOC_OK);
  CHECK(streamalloc_sim_violations(0, &violations) == STREAMALLOC_OK && violations == 0);
  printf("%d failed\n", failures);
  return failures ? 1 : 0;
}
