// What backend.cpp and host.cpp share of libstreamalloc's C ABI, which they reach through
// dlopen/dlsym (the library is not linked): its status values and statistics struct, mirrored
// from crates/streamalloc-capi/include/streamalloc.h field for field (CI checks that they stay
// so: crates/streamalloc-capi/tests/header.rs); the lookup of a function
// by name; the message of an install that failed.
#pragma once

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace streamalloc_lib {

// streamalloc_status_t (values as in streamalloc.h).
enum Status : int {
  OK = 0,
  OUT_OF_MEMORY = 1,
  INVALID_ARGUMENT = 2,
  LIMIT_EXCEEDED = 5,
};

// streamalloc_stats_t, field for field.
struct LibStats {
  size_t allocated;
  size_t allocated_peak;
  size_t reserved;
  size_t reserved_peak;
  size_t cached;
  size_t largest_free_block;
  size_t pending_release;
  uint64_t live_allocations;
  uint64_t total_allocations;
  uint64_t total_frees;
  uint64_t device_allocs;
  uint64_t device_frees;
  uint64_t failures;
  uint64_t retries;
};

// Sets `out` to the function `name` of the library `handle`; a name not found joins `missing`.
template <typename F>
void resolve(void* handle, const char* name, F& out, std::string& missing) {
  out = reinterpret_cast<F>(dlsym(handle, name));
  if (out == nullptr) {
    missing += missing.empty() ? name : std::string(", ") + name;
  }
}

// Writes `message` to the caller's buffer `err` of `errlen` bytes (cut to fit), if there is one.
inline void set_error(char* err, size_t errlen, const std::string& message) {
  if (err != nullptr && errlen > 0) {
    std::snprintf(err, errlen, "%s", message.c_str());
  }
}

} // namespace streamalloc_lib
