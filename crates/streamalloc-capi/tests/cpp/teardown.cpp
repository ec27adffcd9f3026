// Calls that fail, from a thread_local destructor (at thread exit) and from a global destructor
// (after main returns), when the library's own thread-locals may already be gone. The header
// promises that no call aborts: the process must exit 0. Prints one line per stage reached.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "streamalloc.h"

static void* const FOREIGN = reinterpret_cast<void*>(0xdead0000);

// Failing calls of every kind that reports an error, then a working allocation and free.
static void failing_calls(const char* where) {
  streamalloc_free(FOREIGN, 1, 0, nullptr);
  if (streamalloc_deallocate(FOREIGN) != STREAMALLOC_INVALID_ARGUMENT) std::printf("%s: deallocate not an error\n", where);
  const char* e = streamalloc_last_error();
  if (e == nullptr) std::printf("%s: last_error returned NULL\n", where);
  void* p = nullptr;
  if (streamalloc_allocate(4096, 0, nullptr, &p) == STREAMALLOC_OK) streamalloc_deallocate(p);
  std::printf("%s: done\n", where);
  std::fflush(stdout);
}

struct AtThreadExit {
  ~AtThreadExit() { failing_calls("thread_local destructor"); }
};

struct AfterMain {
  ~AfterMain() { failing_calls("global destructor"); }
};

static AfterMain after_main;
thread_local AtThreadExit at_thread_exit;

int main() {
  const char* conf = std::getenv("STREAMALLOC_CONF");
  if (conf == nullptr || streamalloc_configure(conf) != STREAMALLOC_OK) {
    std::printf("configure failed\n");
    return 1;
  }
  std::thread t([] {
    // The thread_local is constructed first, so its destructor runs after the library's
    // thread-locals (made by the failing call below) are destroyed.
    (void)&at_thread_exit;
    failing_calls("thread body");
  });
  t.join();
  (void)&at_thread_exit;
  failing_calls("main");
  std::printf("main returns\n");
  return 0;
}
