/* What the C tests share: CHECK(cond) counts a check and, when `cond` is false, a failure,
 * printing the condition, its place and the library's last error. */
#pragma once

#include <stdio.h>

#include "streamalloc.h"

static int checks, failures;

#define CHECK(cond)                                                                     \
  do {                                                                                  \
    checks++;                                                                           \
    if (!(cond)) {                                                                      \
      failures++;                                                                       \
      printf("FAILED %s:%d: %s (last error: %s)\n", __FILE__, __LINE__, #cond,         \
             streamalloc_last_error());                                                 \
    }                                                                                   \
  } while (0)
