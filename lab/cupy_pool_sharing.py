#!/usr/bin/env python3
"""Pool sharing between CuPy and streamalloc's AsyncPool (strategy=async, pool=default).

Both allocate from the device's default stream-ordered pool in one process, so memory one
frees into the pool is reused by the other without the device footprint growing:

1. CuPy (MemoryAsyncPool) allocates and frees 1 GiB; AsyncPool then allocates 1 GiB.
2. AsyncPool allocates and frees 1 GiB; CuPy then allocates 1 GiB.

The default pool's release threshold is raised first, so freed memory stays in the pool
(otherwise a synchronization could return it to the OS and hide the sharing). Prints one
line `POOL_SHARING ...` per direction and exits non-zero if a footprint grew by more than
the slack.

Usage: python3 lab/cupy_pool_sharing.py [path/to/libstreamalloc.so]
(default: target/release/libstreamalloc.so, or $STREAMALLOC_CAPI_LIB).
"""

import argparse
import ctypes
import os
import sys

cupy = None  # imported by main(): --help answers without CuPy

GIB = 1 << 30
SLACK = 64 << 20  # driver bookkeeping and granularity


def load(path):
    lib = ctypes.CDLL(path)
    lib.streamalloc_configure.argtypes = [ctypes.c_char_p]
    lib.streamalloc_configure.restype = ctypes.c_int
    lib.streamalloc_allocate.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.streamalloc_allocate.restype = ctypes.c_int
    lib.streamalloc_deallocate.argtypes = [ctypes.c_void_p]
    lib.streamalloc_deallocate.restype = ctypes.c_int
    lib.streamalloc_last_error.argtypes = []
    lib.streamalloc_last_error.restype = ctypes.c_char_p
    return lib


def check(lib, status, what):
    if status != 0:
        raise SystemExit(f"{what} failed ({status}): {lib.streamalloc_last_error().decode()}")


def used():
    cupy.cuda.runtime.deviceSynchronize()
    free, total = cupy.cuda.runtime.memGetInfo()
    return total - free


def main():
    global cupy
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lib", nargs="?", default=os.environ.get("STREAMALLOC_CAPI_LIB", "target/release/libstreamalloc.so"),
                        help="libstreamalloc.so to load")
    args = parser.parse_args()
    import cupy

    lib = load(args.lib)
    check(lib, lib.streamalloc_configure(b"strategy=async,pool=default"), "streamalloc_configure")

    cupy.cuda.Device(0).use()
    pool = cupy.cuda.runtime.deviceGetDefaultMemPool(0)
    cupy.cuda.runtime.memPoolSetAttribute(pool, cupy.cuda.runtime.cudaMemPoolAttrReleaseThreshold, 2**64 - 1)
    cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
    stream = cupy.cuda.Stream(non_blocking=True)
    ok = True

    with stream:
        # 1. CuPy frees into the default pool; AsyncPool reuses it.
        x = cupy.empty(GIB, dtype=cupy.uint8)
        x.fill(1)
        del x
        before = used()
        out = ctypes.c_void_p()
        check(lib, lib.streamalloc_allocate(GIB, 0, stream.ptr, ctypes.byref(out)), "streamalloc_allocate")
        grew = used() - before
        print(f"POOL_SHARING cupy_then_asyncpool grew={grew} bytes (slack {SLACK})")
        ok &= grew <= SLACK
        check(lib, lib.streamalloc_deallocate(out), "streamalloc_deallocate")

        # 2. AsyncPool frees into the default pool; CuPy reuses it.
        before = used()
        y = cupy.empty(GIB, dtype=cupy.uint8)
        y.fill(2)
        grew = used() - before
        print(f"POOL_SHARING asyncpool_then_cupy grew={grew} bytes (slack {SLACK})")
        ok &= grew <= SLACK
        del y

    cupy.cuda.runtime.memPoolSetAttribute(pool, cupy.cuda.runtime.cudaMemPoolAttrReleaseThreshold, 0)
    if not ok:
        raise SystemExit("the default pool was not shared: the device footprint grew")


if __name__ == "__main__":
    main()
