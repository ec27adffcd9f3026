"""CuPy on streamalloc: arrays on two non-blocking streams, memory reused across them safely.

Run on a CUDA machine with the wheel installed (README: Install):
    STREAMALLOC_CONF=strategy=stream_safe python3 examples/cupy_plugin.py
"""
import cupy

import streamalloc.cupy

# Every CuPy allocation from here on goes through streamalloc, on CuPy's current stream.
# checked=True would raise cupy.cuda.memory.OutOfMemoryError instead of handing CuPy a null
# pointer, at the cost of a Python call per allocation.
streamalloc.cupy.enable(None)

a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
total = 0.0
for step in range(10):
    with a:
        x = cupy.random.random((2048, 2048), dtype=cupy.float32)
        y = x @ x
        total += float(y.sum())
    del x, y  # freed on stream a: reused on b only after a's queued work
    with b:
        z = cupy.ones((2048, 2048), dtype=cupy.float32)
        assert float(z.sum()) == 2048 * 2048
    del z
cupy.cuda.Device().synchronize()
print(f"sum {total:.1f}")
