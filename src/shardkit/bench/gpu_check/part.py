"""One gpu-check part in this process (started by the runner, in a process group of its own)::

    python3 -m shardkit.bench.gpu_check.part NAME --record FILE --stack FILE --limit SECONDS [--small]

Records go to ``FILE`` after every check. A watchdog (``faulthandler``) writes every thread's stack to the stack
file shortly before the runner's kill, so a hang names the call it hangs in. SIGTERM (sent when the runner dies)
kills this part's whole process group, ranks included.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from shardkit.bench.gpu_check.results import Outcome, Results
from shardkit.bench.gpu_check.settings import inner_timeout_s

#: Part name -> "module:function" (imported only when that part runs).
PART_FUNCTIONS = {
    "env": "parts_core:part_env",
    "strategies": "parts_core:part_strategies",
    "amp": "parts_amp:part_amp",
    "fsdp": "parts_fsdp:part_fsdp",
    "checkpoint": "parts_checkpoint:part_checkpoint",
    "ranks2": "parts_ranks:part_ranks2",
    "pipeline": "parts_pipeline:part_pipeline",
    "throughput": "parts_big:part_throughput",
    "plan": "parts_big:part_plan",
    "compile": "parts_fsdp:part_compile",
    "cuda_tests": "parts_core:part_cuda_tests",
}


def _hang_until_killed(res: Results) -> None:
    """The plumbing's self-test: a child of its own (as ranks are), one finished check, then a hang that the
    runner must kill, with the child, and that the watchdog must name."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    res.check("before_the_hang", lambda: Outcome(True, {"pid": os.getpid(), "child_pid": child.pid}, "always"))
    threading.Event().wait()


def _kill_own_group(signum: int, frame: Any) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the named part; its checks land in the record file as they finish."""
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("--record", required=True)
    parser.add_argument("--stack", required=True)
    parser.add_argument("--limit", type=float, required=True)
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args(argv)
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _kill_own_group)
    stack_file = open(args.stack, "w")  # noqa: SIM115 (open for the part's whole life)
    faulthandler.dump_traceback_later(inner_timeout_s(args.limit), file=stack_file)
    # Exact comparisons need deterministic cuBLAS, set before CUDA starts (see common.deterministic); the timed
    # part keeps cuBLAS's defaults.
    if args.name != "throughput":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    res = Results(args.name, Path(args.record))
    if args.name == "selftest_hang":
        _hang_until_killed(res)
        return 0
    from shardkit.bench.gpu_check.common import PartContext, close_world

    ctx = PartContext(small=args.small, deadline=started + inner_timeout_s(args.limit))
    module_name, function = PART_FUNCTIONS[args.name].split(":")
    status = 0
    try:
        module = importlib.import_module(f"shardkit.bench.gpu_check.{module_name}")
        getattr(module, function)(res, ctx)
    except Exception as err:  # outside any check (an import, a setup step): recorded, the part fails
        trace = traceback.format_exc()[-4000:]
        res.record("part_error", {"verdict": "fail", "why": f"{type(err).__name__}: {err}"[:2000], "value": None,
                                  "threshold": None, "trace": trace, "secs": 0.0})  # fmt: skip
        status = 1
    finally:
        res.flush()
        close_world()
    faulthandler.cancel_dump_traceback_later()
    return status


if __name__ == "__main__":
    sys.exit(main())
