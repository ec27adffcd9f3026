"""What the GPU case workers (torch_cases.py, cupy_cases.py) share: how a case reports.

A worker runs one case in its own process and ends with one line `RESULT {json}` holding
what identifies the case, `ok`, `failures` (each broken guarantee in words) and the figures
the case saw. Its exit status is 0 when every guarantee held, 1 when one broke and 2 when
the case raised (the traceback is printed above the RESULT line). conftest.py reads both.
"""

import json
import os
import sys
import traceback

RESULT_PREFIX = "RESULT "
"""The start of the line that carries a worker's result."""

MIB = 1 << 20
GIB = 1 << 30


def frees_synchronize(conf):
    """Whether `conf` is streamalloc's `plain` strategy, whose free (cuMemFree) waits for the
    whole device: a stream can never still be busy when freed memory is reused there, so the
    cases check its data without requiring the busy window they need elsewhere."""
    return conf.split(",")[0].strip() == "strategy=plain"


class Report:
    """The outcome of one case: `info` (figures seen) and `failures` (guarantees broken)."""

    def __init__(self, **identity):
        self.identity = identity
        self.info = {}
        self.failures = []

    def expect(self, condition, failure):
        """Records `failure` unless `condition` holds; returns `condition`."""
        if not condition:
            self.failures.append(failure)
        return bool(condition)

    def run(self, case, *args):
        """Runs `case(self, *args)`, prints the RESULT line and exits with the case's status."""
        status = 0
        try:
            case(self, *args)
        except Exception as e:  # the case's own error is its result: report it, then fail
            traceback.print_exc()
            first_line = str(e).splitlines()[0] if str(e) else ""
            self.failures.append(f"raised {type(e).__name__}: {first_line}")
            status = 2
        if self.failures and status == 0:
            status = 1
        result = {**self.identity, "ok": not self.failures, "failures": self.failures, **self.info}
        sys.stderr.flush()
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        sys.exit(status)


def run_worker(argv, cases):
    """A torch worker's `main`: ARGV is `worker CASE CONF [ARG]`; runs `cases[CASE](report, CONF
    [, ARG])` with the case, the configuration, torch's backend path
    (STREAMALLOC_TORCH_BACKEND) and the argument as the RESULT's identity, and exits with its
    status."""
    if len(argv) not in (3, 4) or argv[1] not in cases:
        sys.exit(f"usage: {argv[0]} CASE CONF [ARG]  (CASE: {', '.join(cases)})")
    case, conf, extra = argv[1], argv[2], argv[3:]
    identity = dict(case=case, conf=conf, path=os.environ.get("STREAMALLOC_TORCH_BACKEND", "auto"))
    if extra:
        identity["arg"] = extra[0]
    Report(**identity).run(cases[case], conf, *extra)
