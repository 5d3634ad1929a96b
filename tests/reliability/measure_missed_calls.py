"""How long each call made by rank 0 only takes to be reported at shardkit's default settings (a program, not a
test: each case waits the full default deadline, about 3.5 minutes, all cases side by side).

    cd tests/reliability && PYTHONPATH=../../src:.. python measure_missed_calls.py fsdp_state_dict save_checkpoint \\
        oss_consolidate smp_state_dict

Rank 0 makes the call; rank 1 waits in a ``dist.barrier()``, as in issue 23. Prints, per case and rank, the seconds
to each warning and to the error, and the messages. ``cost`` instead times the check (2 ranks under torch's elastic
launcher, so over its TCP store): one FSDP ``state_dict()`` with and without it, and the check alone.
"""

from __future__ import annotations

import concurrent.futures
import logging
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch.distributed as dist
from rel_testlib import build, train

from shardkit.checkpoint import save_checkpoint
from shardkit.testing import run_distributed

STRATEGY = {"fsdp_state_dict": "fsdp", "save_checkpoint": "ddp", "oss_consolidate": "oss", "smp_state_dict": "smp"}


class _Timed(logging.Handler):
    def __init__(self, start: float) -> None:
        super().__init__(logging.WARNING)
        self.start = start
        self.seen: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((round(time.monotonic() - self.start, 1), record.getMessage()))


def _case(rank: int, world_size: int, which: str, directory: str) -> None:
    run = build(STRATEGY[which], seed=0)
    train(run, range(1), rank)
    start = time.monotonic()
    warnings = _Timed(start)
    logging.getLogger("shardkit").addHandler(warnings)
    try:
        if rank != 0:
            dist.barrier()
        elif which == "save_checkpoint":
            save_checkpoint(directory, step=1, model=run.model, optimizer=run.optimizer)
        elif which == "oss_consolidate":
            run.optimizer.consolidate_state_dict()
        else:
            run.model.state_dict()
    except Exception as err:
        seen = {
            "rank": rank,
            "error_s": round(time.monotonic() - start, 1),
            "warnings_s": [t for t, _ in warnings.seen],
        }
        first = warnings.seen[0][1] if warnings.seen else None
        raise RuntimeError(f"MEASURED {seen}\nFIRST WARNING {first}\nERROR {err}") from None  # ends this rank


def _measure(which: str) -> tuple[str, str]:
    try:
        run_distributed(_case, 2, which, tempfile.mkdtemp() + "/ckpt", timeout_s=1800)
    except Exception as err:
        lines = str(err).splitlines()
        keep = [line for line in lines if "MEASURED" in line or line.startswith(("FIRST WARNING", "ERROR"))]
        return which, "\n".join(keep)
    return which, "no error (unexpected)"


def _timed_ms(fn: Callable[[], Any]) -> float:
    dist.barrier()  # every call starts with the ranks aligned
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def _cost(calls: int = 200) -> str:
    from shardkit.distributed import arrival

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    run = build("fsdp", seed=0)
    train(run, range(1), rank)
    checked_call = arrival.every_rank_calls

    def unchecked() -> Any:
        arrival.every_rank_calls = lambda *args, **kwargs: None  # type: ignore[assignment]
        try:
            return run.model.state_dict()
        finally:
            arrival.every_rank_calls = checked_call

    for _ in range(20):
        _timed_ms(run.model.state_dict)
    times: dict[str, list[float]] = {"with": [], "without": [], "alone": []}
    for _ in range(calls):  # interleaved, so drift and warm-up weigh on both alike
        times["with"].append(_timed_ms(run.model.state_dict))
        times["without"].append(_timed_ms(unchecked))
        times["alone"].append(_timed_ms(lambda: arrival.every_rank_calls("check()")))
    dist.destroy_process_group()
    ms = {key: statistics.median(values) for key, values in times.items()}
    return (
        f"rank {rank}: state_dict {ms['with']:.3f} ms with the check, {ms['without']:.3f} ms without; "
        f"the check alone {ms['alone']:.3f} ms (medians of {calls})"
    )


def main(cases: list[str]) -> None:
    """Run ``cases`` side by side and print what each rank reported, and when."""
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        results: Any = pool.map(_measure, cases)
        for which, report in results:
            print(f"===== {which}\n{report}")


if __name__ == "__main__":
    if sys.argv[1:] == ["cost"]:
        from shardkit.launch import launch_local

        print("\n".join(launch_local(_cost, 2)))
    else:
        main(sys.argv[1:] or list(STRATEGY))
