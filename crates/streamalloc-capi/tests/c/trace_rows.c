/* Writes a side stream's record_stream, use and wait rows through the C API on the simulator
 * (STREAMALLOC_CONF names device=sim and, or not, trace=PATH). Prints one line per failed
 * check; exits 0 when all pass, 1 otherwise. */
#include <stdint.h>
#include <stdio.h>

#include "check.h"

int main(void) {
  cudaStream_t side = NULL;
  void* p = NULL;
  CHECK(streamalloc_sim_create_stream(0, &side) == STREAMALLOC_OK);
  CHECK(streamalloc_allocate(1 << 20, 0, NULL, &p) == STREAMALLOC_OK);
  CHECK(streamalloc_record_stream(p, side) == STREAMALLOC_OK);
  CHECK(streamalloc_trace_use(0, p, side, 5000000) == STREAMALLOC_OK);
  CHECK(streamalloc_trace_wait(0, NULL, side) == STREAMALLOC_OK);
  /* A zero-size allocation's NULL writes nothing; a stream the simulator never made is refused. */
  CHECK(streamalloc_trace_use(0, NULL, side, 1) == STREAMALLOC_OK);
  CHECK(streamalloc_trace_use(0, p, (cudaStream_t)(uintptr_t)0x1230, 1) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(streamalloc_trace_wait(0, (cudaStream_t)(uintptr_t)0x1230, NULL) == STREAMALLOC_INVALID_ARGUMENT);
  CHECK(streamalloc_deallocate(p) == STREAMALLOC_OK);
  printf("%p %d failed\n", p, failures);
  return failures ? 1 : 0;
}
