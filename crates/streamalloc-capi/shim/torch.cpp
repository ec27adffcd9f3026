// The C++ half of the PyTorch hooks (src/torch.rs), compiled into libstreamalloc.so by
// build.rs. It does the two things Rust cannot: it owns a std::function (torch passes the
// begin-allocate-to-pool filter as a std::function<bool(cudaStream_t)> by value), and it
// throws a C++ exception (the only way a failed allocation reaches torch's caller as an
// error: torch takes a null pointer for memory).
//
// The exported hooks themselves are Rust functions (a Rust cdylib exports only its own
// symbols); these helpers are internal to the library.
#include <cstdint>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

struct CUstream_st;
using cudaStream_t = CUstream_st*;  // CUDA's own typedef
using Filter = std::function<bool(cudaStream_t)>;

extern "C" {

// Moves the filter that torch passed by value (the Itanium C++ ABI passes a class with a
// non-trivial destructor by the address of a temporary that the caller destroys after the
// call) to the heap; the library owns the result. Null if the host is out of memory.
void* streamalloc_shim_take_filter(void* by_value) noexcept {
  return new (std::nothrow) Filter(std::move(*static_cast<Filter*>(by_value)));
}

// Calls a filter from streamalloc_shim_take_filter. One that throws (torch's checks the
// capture status with AT_CUDA_CHECK) or is empty does not match.
bool streamalloc_shim_call_filter(void* filter, cudaStream_t stream) noexcept {
  try {
    return (*static_cast<Filter*>(filter))(stream);
  } catch (...) {
    return false;
  }
}

// Destroys a filter from streamalloc_shim_take_filter.
void streamalloc_shim_drop_filter(void* filter) noexcept { delete static_cast<Filter*>(filter); }

// Throws std::runtime_error(message), prefixed "CUDA out of memory (streamalloc): " when
// out_of_memory (as torch's own message begins) and "streamalloc: " otherwise. Only called by
// the allocation hook, which torch calls from C++ frames that expect exceptions.
void streamalloc_shim_throw(bool out_of_memory, const char* message) {
  std::string what = out_of_memory ? "CUDA out of memory (streamalloc): " : "streamalloc: ";
  throw std::runtime_error(what + (message != nullptr ? message : "unknown error"));
}

}  // extern "C"
