#!/usr/bin/env python3
"""CUDA tensors shared between processes (issue 54): every sender's allocator against every
receiver's, through torch.multiprocessing (spawn), one cell per process.

    python3 python/tests/gpu/ipc_cases.py CASE SENDER RECEIVER

SENDER is the parent's allocator: `native` (torch's own), `expandable` (torch's own with
expandable_segments:True), `default` (streamalloc's default config: stitched ranges),
`chunks` (streamalloc, backing=chunks), `async` (streamalloc, strategy=async,pool=ipc: the
driver's pool, one of the library's own created exportable). RECEIVER is the
child's: `native` or `streamalloc` (the default config). Cases:

  matrix   the parent fills a tensor (i*7+3), puts it on a queue; the child checks its sum and
           every element, writes -(i*7+3)-5, and the parent reads exactly that; the child
           drops it, the parent frees it. The one cell that cannot work (sender `async`, receiver
           `native`: torch's allocator cannot import a pool's memory, see DESIGN.md "IPC") must
           end in the child with torch's own RuntimeError for a handle of a later version
           (streamalloc's pool handle has version byte 0xff), never an internal assert, and
           the parent's tensor must be unchanged. The expandable sender's tensor is 1 MiB (torch's small pool: 2 MiB
           segments) for a streamalloc receiver, which maps allocations of one granule; its
           large pool's 20 MiB segments are checked to be refused by the child with a message
           saying so (case `large`)
  large    SENDER expandable, RECEIVER streamalloc: a 64 MiB tensor (torch's 20 MiB segments):
           the child's open fails with an error naming the segment size and what to do
  sender_exits  the roles swapped: a child under SENDER's allocator shares a tensor with this
           process (under RECEIVER's) and exits once it is opened; the tensor's view stays
           valid here (sum and elements right, a write and read back), or, for CUDA IPC
           handles (torch's 'c', whose memory the driver may reclaim when its exporter exits),
           fails with a CUDA error, never a crash or wrong data (which of the two is recorded)
  cycles   1,000 share/close cycles (after 20 to warm up): the counts of open descriptors
           (/proc/self/fd) and of host mappings (/proc/self/maps) on both sides, the device's
           free memory, torch.cuda.memory_allocated on the sender and streamalloc's opened
           ranges on a streamalloc receiver, before and after

Output and exit status: see casekit.py (the child's figures are in the RESULT's info).
"""

import gc
import os
import queue
import sys

from casekit import MIB, Report

SENDERS = {
    "native": None,
    "expandable": None,
    "default": "",
    "chunks": "strategy=stream_safe,backing=chunks",
    "async": "strategy=async,pool=ipc",
}
RECEIVERS = {"native": None, "streamalloc": ""}
WAIT = 120


def counts():
    """Descriptors and host mappings of this process."""
    with open("/proc/self/maps") as maps:
        return len(os.listdir("/proc/self/fd")), sum(1 for _ in maps)


def child_main(inbox, outbox, receiver):
    """The receiving process: opens what comes, checks, writes, drops, reports figures."""
    import torch

    try:
        if RECEIVERS[receiver] is not None:
            import streamalloc.torch

            streamalloc.torch.enable(RECEIVERS[receiver])
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the context, before the first figures
        while True:
            msg = inbox.get()
            if msg == "stop":
                break
            if msg == "counts":
                gc.collect()
                outbox.put(("counts", counts()))
                continue
            mode, x = msg
            del msg
            n = x.numel()
            i = torch.arange(n, dtype=torch.int64, device="cuda")
            expected = i * 7 + 3
            same = bool(torch.equal(x, expected))
            total = int(x.sum())
            if mode == "write":
                x.mul_(-1).sub_(5)
                torch.cuda.synchronize()
            outbox.put(("checked", (same, total)))
            # The message held the tensor too: with it gone, the last reference goes here (a
            # collection per message, 20-100 ms, is left to the figures' "counts").
            del x, i, expected
            torch.cuda.synchronize()
            outbox.put(("dropped", True))
        outbox.put(("stopped", True))
    except Exception as e:  # reported to the parent, which fails the case
        outbox.put(("error", f"{type(e).__name__}: {str(e)[:2000]}"))


class Cell:
    """The parent's side: its allocator set up, a child started with the receiver's."""

    def __init__(self, report, sender, receiver):
        self.report = report
        if sender == "expandable":
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        else:
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if SENDERS[sender] is None:
            os.environ["STREAMALLOC_TORCH"] = "0"  # torch's own allocator, whatever autoload says
        import torch
        import torch.multiprocessing as mp

        self.torch = torch
        if SENDERS[sender] is not None:
            import streamalloc.torch

            streamalloc.torch.enable(SENDERS[sender])
            report.expect(streamalloc.torch.active() == "backend", f"sender: {streamalloc.torch.active()!r}")
        torch.cuda.init()
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.SimpleQueue(), ctx.Queue()
        self.proc = ctx.Process(target=child_main, args=(self.inbox, self.outbox, receiver))
        # The child's allocator is the receiver's alone: no streamalloc inherited (enable()
        # makes started processes enable it), no expandable segments.
        saved = dict(os.environ)
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        os.environ.pop("STREAMALLOC_CONF", None)
        os.environ["STREAMALLOC_TORCH"] = "0"  # the child enables streamalloc itself, or not at all
        try:
            self.proc.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def answer(self, what):
        try:
            kind, value = self.outbox.get(timeout=WAIT)
        except queue.Empty:
            self.report.failures.append(f"the child sent nothing back within {WAIT} s ({what})")
            return None
        if kind == "error":
            self.report.failures.append(f"the child failed ({what}): {value}")
            return None
        return kind, value

    def close(self):
        failed = bool(self.report.failures) or sys.exc_info()[0] is not None
        # A child that ended on a refusal (the matrix's async -> native cell) answers nothing.
        if not failed and self.proc.is_alive():
            self.inbox.put("stop")
            self.answer("stopping")
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
            if not failed:
                self.report.failures.append("the child process did not exit within 60 s")
        elif not failed:
            self.report.expect(self.proc.exitcode == 0, f"the child exited with {self.proc.exitcode}")


def filled(torch, nbytes):
    n = nbytes // 8
    return torch.arange(n, dtype=torch.int64, device="cuda") * 7 + 3


def case_matrix(report, sender, receiver):
    cell = Cell(report, sender, receiver)
    torch = cell.torch
    try:
        nbytes = MIB if sender == "expandable" else 32 * MIB
        x = filled(torch, nbytes)
        torch.cuda.synchronize()
        n = x.numel()
        want = 7 * n * (n - 1) // 2 + 3 * n
        try:
            cell.inbox.put(("write", x))
        except RuntimeError as e:
            report.failures.append(f"the sender refused a cell that should work: {str(e)[:500]}")
            return
        if sender == "async" and receiver == "native":
            # Torch's allocator cannot import memory of a driver pool: its own error, in the child.
            try:
                kind, value = cell.outbox.get(timeout=WAIT)
            except queue.Empty:
                report.failures.append("the child sent nothing back")
                return
            report.info["child"] = [kind, str(value)[:500]]
            report.expect(kind == "error" and "future version of torch" in str(value)
                          and "INTERNAL ASSERT" not in str(value),
                          f"the child's refusal is not torch's version error: {kind} {str(value)[:500]}")
            report.expect(bool(torch.equal(x, filled(torch, nbytes))), "the tensor changed after the refusal")
            cell.proc.join(60)  # the child ended on the error: nothing more to stop
            return
        got = cell.answer("after receiving the tensor")
        if got is None:
            return
        same, total = got[1]
        report.info["child_sum"] = total
        report.expect(same and total == want, f"the child read wrong data: equal {same}, sum {total}, want {want}")
        expected = -filled(torch, nbytes) - 5
        report.expect(bool(torch.equal(x, expected)), "the parent does not see what the child wrote")
        cell.answer("after dropping the tensor")
        del x, expected
        gc.collect()
        torch.cuda.ipc_collect()
    finally:
        cell.close()


def case_large(report, sender, receiver):
    report.expect(sender == "expandable" and receiver == "streamalloc", "large: expandable -> streamalloc only")
    cell = Cell(report, sender, receiver)
    torch = cell.torch
    try:
        x = filled(torch, 64 * MIB)
        torch.cuda.synchronize()
        cell.inbox.put(("read", x))
        try:
            kind, value = cell.outbox.get(timeout=WAIT)
        except queue.Empty:
            report.failures.append("the child sent nothing back")
            return
        report.info["child"] = [kind, str(value)[:500]]
        report.expect(kind == "error" and "PyTorch's own allocator" in str(value) and "bytes" in str(value),
                      f"the child's refusal does not say why: {kind} {str(value)[:500]}")
        del x
        torch.cuda.ipc_collect()
        # The child ended on the error: nothing more to stop.
        cell.proc.join(60)
    finally:
        if cell.proc.is_alive():
            cell.proc.kill()
            cell.proc.join(10)


def case_cycles(report, sender, receiver, warm=20, cycles=1000):
    cell = Cell(report, sender, receiver)
    torch = cell.torch
    try:
        if sender == "async" and receiver == "native":
            report.failures.append("torch's own receiver cannot import a pool's memory: no cycles to run")
            return
        nbytes = MIB if sender == "expandable" else 8 * MIB

        def one():
            x = filled(torch, nbytes)
            torch.cuda.synchronize()
            cell.inbox.put(("read", x))
            got = cell.answer("a cycle")
            if got is None or not got[1][0]:
                report.failures.append(f"a cycle read wrong data: {got}")
                return False
            if cell.answer("a cycle's drop") is None:
                return False
            del x
            torch.cuda.ipc_collect()
            return True

        def figures():
            gc.collect()
            torch.cuda.ipc_collect()
            torch.cuda.synchronize()
            cell.inbox.put("counts")
            child = cell.answer("counts")
            free, _ = torch.cuda.mem_get_info()
            mine = counts()
            return {"sender_fds": mine[0], "sender_maps": mine[1], "receiver_fds": child[1][0] if child else None,
                    "receiver_maps": child[1][1] if child else None, "device_free": free,
                    "sender_allocated": torch.cuda.memory_allocated()}

        for _ in range(warm):
            if not one():
                return
        before = figures()
        for k in range(cycles):
            if not one():
                report.info["failed_at_cycle"] = k
                return
        after = figures()
        report.info.update(before=before, after=after, cycles=cycles)
        for key in ("sender_fds", "receiver_fds"):
            report.expect(after[key] == before[key], f"{key}: {before[key]} before, {after[key]} after {cycles} cycles")
        for key in ("sender_maps", "receiver_maps"):
            report.expect(after[key] <= before[key] + 8,
                          f"{key}: {before[key]} before, {after[key]} after {cycles} cycles")
        report.expect(after["sender_allocated"] == before["sender_allocated"],
                      f"sender allocated {before['sender_allocated']} before, {after['sender_allocated']} after")
        report.expect(before["device_free"] - after["device_free"] <= 4 * MIB,
                      f"device free {before['device_free']} before, {after['device_free']} after {cycles} cycles")
    finally:
        cell.close()


def sender_child(outbox, inbox, sender, nbytes):
    """The sharing process of `sender_exits`: shares a filled tensor, exits once it is opened."""
    try:
        if sender == "expandable":
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        import torch

        if SENDERS[sender] is not None:
            import streamalloc.torch

            streamalloc.torch.enable(SENDERS[sender])
        x = filled(torch, nbytes)
        torch.cuda.synchronize()
        outbox.put(x)
        inbox.get()  # opened by the parent
    except Exception as e:
        outbox.put(f"{type(e).__name__}: {str(e)[:2000]}")
    os._exit(0)  # at once: no teardown that waits for the receiver


def case_sender_exits(report, sender, receiver):
    import torch.multiprocessing as mp

    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if RECEIVERS[receiver] is None:
        os.environ["STREAMALLOC_TORCH"] = "0"
    import torch

    if RECEIVERS[receiver] is not None:
        import streamalloc.torch

        streamalloc.torch.enable(RECEIVERS[receiver])
    torch.cuda.init()
    nbytes = MIB if sender == "expandable" else 32 * MIB
    ctx = mp.get_context("spawn")
    outbox, inbox = ctx.Queue(), ctx.SimpleQueue()
    saved = dict(os.environ)
    # The child's allocator is the sender's alone: it enables streamalloc itself, or not at all.
    os.environ["STREAMALLOC_TORCH"] = "0"
    os.environ.pop("STREAMALLOC_CONF", None)
    proc = ctx.Process(target=sender_child, args=(outbox, inbox, sender, nbytes))
    try:
        proc.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        try:
            x = outbox.get(timeout=WAIT)
        except queue.Empty:
            report.failures.append("the sender sent nothing")
            return
        if isinstance(x, str):
            report.expect(sender == "async", f"the sender failed: {x}")
            report.info["sender_error"] = x[:500]
            return
        inbox.put("opened")
        proc.join(60)
        report.info["sender_exit"] = proc.exitcode
        try:
            want = filled(torch, nbytes)
            same = bool(torch.equal(x, want))
            x.add_(1)
            torch.cuda.synchronize()
            again = bool(torch.equal(x, want + 1))
            report.info["after_sender_exit"] = "valid"
            report.expect(same and again, f"wrong data after the sender exited: read {same}, write {again}")
        except RuntimeError as e:
            report.info["after_sender_exit"] = f"error: {str(e).splitlines()[0][:300]}"
            report.expect(sender in ("native", "chunks"), f"mapped memory invalid after the sender exited: {e}")
        del x
        gc.collect()
        torch.cuda.synchronize()
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


CASES = {"matrix": case_matrix, "large": case_large, "cycles": case_cycles, "sender_exits": case_sender_exits}


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in CASES or sys.argv[2] not in SENDERS or sys.argv[3] not in RECEIVERS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(CASES)}}} {{{','.join(SENDERS)}}} {{{','.join(RECEIVERS)}}}")
    case, sender, receiver = sys.argv[1:]
    Report(case=case, sender=sender, receiver=receiver).run(CASES[case], sender, receiver)
