"""What the PyTorch measurement programs beside this file share (torch_loops.py,
torch_alloc_overhead.py, gpt2_train.py): each allocator's environment, installing streamalloc in
a child process, running children with a bound, and sampling the device's used memory.

The programs import it as a sibling (`python3 lab/X.py` puts this folder first on
sys.path), in the parent and in the children they spawn alike.
"""

import os
import signal
import subprocess
import sys
import threading
import time


def allocator_env(cuda_conf=None, backend=None):
    """The environment of one allocator's process: PyTorch's allocator settings (None: removed)
    and the path `streamalloc.torch.enable()` takes (`STREAMALLOC_TORCH_BACKEND`, None: removed)."""
    return {"PYTORCH_ALLOC_CONF": None, "PYTORCH_CUDA_ALLOC_CONF": cuda_conf, "STREAMALLOC_TORCH_BACKEND": backend}


def apply_env(env, overrides):
    """Sets each key of OVERRIDES in the mapping ENV, or removes it where the value is None."""
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value


def child_env(overrides, **defaults):
    """This process's environment with OVERRIDES applied, DEFAULTS set where missing, the
    backend's build cache shared by every child, and unbuffered Python output."""
    env = dict(os.environ)
    apply_env(env, overrides)
    env.setdefault("STREAMALLOC_CACHE", "/tmp/streamalloc-cache")
    for key, value in defaults.items():
        env.setdefault(key, value)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def enable_streamalloc(allocator, info):
    """In a child whose environment chose ALLOCATOR ("pluggable" or "backend"), installs
    streamalloc as torch's allocator and checks that the path taken is ALLOCATOR; records the
    path and the library in INFO."""
    try:
        import streamalloc
        import streamalloc.torch
    except ImportError as e:
        raise RuntimeError(f"cannot import streamalloc ({e}): install the wheel, or run with "
                           f"PYTHONPATH=/tmp/sa-site after lab/run's install_wheel") from e
    streamalloc.torch.enable()
    active = streamalloc.torch.active()
    if active != allocator:
        raise RuntimeError(f"streamalloc.torch.enable() installed {active!r}, not {allocator!r}")
    info["streamalloc_active"] = active
    info["streamalloc_library"] = str(streamalloc.library_path())


def run_child(cmd, env, log_path, timeout):
    """Runs CMD in a session of its own, output to LOG_PATH; kills its whole process group
    (inductor's compile workers included) past TIMEOUT, and what it left behind after it
    ended. Returns (exit status or None, seconds)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    try:  # workers the run left behind (its process group)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return rc, time.perf_counter() - start


def finish_run(result, path, ok):
    """Ends a child run (`--one`): its traceback, if any, to stderr; RESULT as JSON to PATH, or
    to stdout without one; then exits at once with 0 if OK, else 3. The result is written, so
    the interpreter's teardown is skipped (a run torch refused may leave half-recorded CUDA
    graph state behind; nothing at exit matters here)."""
    import json

    if result.get("traceback"):
        print(result["traceback"], file=sys.stderr)
    text = json.dumps(result)
    if path:
        with open(path, "w") as f:
            f.write(text)
    else:
        print(text)
    sys.stdout.flush()
    os._exit(0 if ok else 3)


def write_results(out, name, rows, text):
    """Writes ROWS as JSON lines to OUT/NAME.jsonl and TEXT (their table) to OUT/NAME.md, and
    prints TEXT."""
    import json

    with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def tail(path, n=8):
    """The last N non-blank lines of the file at PATH, joined (at most 1,500 characters)."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-1500:]


def prebuild_backend(env, log_path, timeout):
    """Builds streamalloc's torch backend once (into STREAMALLOC_CACHE) so that no run pays for
    the build. None when it was built or found, else what went wrong."""
    cmd = [sys.executable, "-c", "import streamalloc.torch as t; print('backend:', t.build_backend())"]
    rc, secs = run_child(cmd, env, log_path, timeout)
    if rc == 0:
        print(f"backend built or found in {secs:.0f} s ({tail(log_path, 1)})", flush=True)
        return None
    problem = f"building the backend failed (exit {rc}, {secs:.0f} s): {tail(log_path)}"
    print(problem, flush=True)
    return problem


class NvmlSampler:
    """The device's used memory (NVML) sampled from a thread, when pynvml is importable:
    `peak`, the `baseline` when made, and `error` when NVML could not be used."""

    def __init__(self, index, interval=0.002):
        self.peak, self.baseline, self.interval, self._stop = 0, None, interval, threading.Event()
        self.error = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._info = pynvml.nvmlDeviceGetMemoryInfo
            self.baseline = self._info(self._handle).used
        except Exception as e:  # pynvml missing or NVML unusable: the mem_get_info samples remain
            self._handle, self.error = None, f"{type(e).__name__}: {e}"
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def available(self):
        return self._handle is not None

    def start(self):
        if self.available:
            self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._info(self._handle).used)
            time.sleep(self.interval)

    def stop(self):
        if self.available:
            self._stop.set()
            self._thread.join()
