/* Replays RMM-format traces (CSV: Thread,Time,Action,Pointer,Size,Stream) through
 * libstreamalloc's PyTorch ABI (streamalloc_malloc / streamalloc_free on device 0, the legacy
 * default stream), as PyTorch's CUDAPluggableAllocator calls it: the cost of the C ABI path,
 * without a framework. One untimed pass, then PASSES timed ones; prints the best and the mean
 * ns per operation (the mean shows what a long run pays, such as mappings in every pass).
 * The configuration is STREAMALLOC_CONF's (device=sim replays on the simulator, whose
 * ordering checks add their own cost, more for memory mapped twice). With
 * CAPI_REPLAY_PASSES=1 it also prints each pass: its ns per operation and what the device-0
 * stack's statistics counted in it (device allocations and frees, retries, bytes reserved).
 * Usage: capi_replay PASSES TRACE... (lab/capi-replay.sh builds and runs it). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#include "../crates/streamalloc-capi/include/streamalloc.h"

typedef struct {
  int is_free; /* 0: allocate into slot, 1: free slot */
  int slot;
  size_t size;
} Op;

typedef struct {
  Op* ops;
  int n, slots;
} Trace;

/* Reads a trace; each allocation gets a slot, a free names its allocation's slot (frees of
 * pointers never allocated in the trace are dropped). Up to 4M distinct pointers. */
static int load(const char* path, Trace* t) {
  FILE* f = fopen(path, "r");
  if (!f) return -1;
  size_t cap = 1 << 22, mask = cap - 1, room = 1 << 16;
  unsigned long long* keys = calloc(cap, sizeof *keys);
  int* slot_of = calloc(cap, sizeof *slot_of);
  t->ops = malloc(room * sizeof(Op));
  t->n = t->slots = 0;
  char line[512];
  if (!fgets(line, sizeof line, f)) { /* header */
    fclose(f);
    return -1;
  }
  while (fgets(line, sizeof line, f)) {
    char* p = strchr(line, ',');            /* after Thread */
    if (!p || !(p = strchr(p + 1, ','))) continue; /* after Time */
    int is_alloc = strncmp(p + 1, "allocate", 8) == 0;
    if (!(p = strchr(p + 1, ','))) continue; /* after Action */
    unsigned long long ptr = strtoull(p + 1, &p, 16);
    size_t size = strtoull(p + 1, NULL, 10);
    size_t h = (ptr * 0x9E3779B97F4A7C15ULL >> 40) & mask;
    while (keys[h] && keys[h] != ptr) h = (h + 1) & mask;
    if ((size_t)t->n == room) t->ops = realloc(t->ops, (room *= 2) * sizeof(Op));
    if (is_alloc) {
      keys[h] = ptr;
      slot_of[h] = t->slots;
      t->ops[t->n++] = (Op){0, t->slots++, size};
    } else if (keys[h] == ptr && slot_of[h] >= 0) {
      t->ops[t->n++] = (Op){1, slot_of[h], size};
      slot_of[h] = -1;
    }
  }
  fclose(f);
  free(keys);
  free(slot_of);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s PASSES TRACE...\n", argv[0]);
    return 2;
  }
  int passes = atoi(argv[1]), failed = 0;
  for (int a = 2; a < argc; a++) {
    Trace t;
    if (load(argv[a], &t)) {
      fprintf(stderr, "%s: cannot read\n", argv[a]);
      failed = 1;
      continue;
    }
    void** live = calloc(t.slots, sizeof(void*));
    double best = 0, sum = 0;
    int each = getenv("CAPI_REPLAY_PASSES") && atoi(getenv("CAPI_REPLAY_PASSES"));
    streamalloc_stats_t before = {0}, after = {0};
    for (int pass = 0; pass <= passes; pass++) {
      struct timespec t0, t1;
      if (each) streamalloc_stats(0, &before);
      clock_gettime(CLOCK_MONOTONIC, &t0);
      for (int i = 0; i < t.n; i++) {
        const Op* o = &t.ops[i];
        if (!o->is_free) {
          live[o->slot] = streamalloc_malloc((ssize_t)o->size, 0, NULL);
          if (!live[o->slot] && o->size) {
            fprintf(stderr, "%s: allocation of %zu bytes failed\n", argv[a], o->size);
            return 1;
          }
        } else {
          streamalloc_free(live[o->slot], (ssize_t)o->size, 0, NULL);
          live[o->slot] = NULL;
        }
      }
      for (int s = 0; s < t.slots; s++)
        if (live[s]) streamalloc_free(live[s], 0, 0, NULL), live[s] = NULL;
      clock_gettime(CLOCK_MONOTONIC, &t1);
      double ns = ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / t.n;
      if (pass > 0 && (best == 0 || ns < best)) best = ns;
      if (pass > 0) sum += ns;
      if (each && streamalloc_stats(0, &after) == STREAMALLOC_OK)
        printf("  pass %2d %8.1f ns/op, device allocs %llu frees %llu, retries %llu, reserved %zu\n",
               pass, ns, (unsigned long long)(after.device_allocs - before.device_allocs),
               (unsigned long long)(after.device_frees - before.device_frees),
               (unsigned long long)(after.retries - before.retries), after.reserved);
    }
    const char* name = strrchr(argv[a], '/');
    printf("%-28s %8d ops %8.1f ns/op best %8.1f mean\n", name ? name + 1 : argv[a], t.n, best,
           passes > 0 ? sum / passes : 0);
    free(live);
    free(t.ops);
  }
  return failed;
}
