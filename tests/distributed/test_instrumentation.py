"""Meters, simulated links and collective checks see collectives issued on any thread while their scope is open.

On CUDA, autograd runs backward hooks on device threads that do not share the caller's context; here a plain
thread runs the backward pass, which puts the hooks on a thread of its own in the same way.
"""

import threading
import time
from typing import Any

import pytest
import torch

from shardkit.distributed import CollectiveMismatchError, CommMeter, check_collectives, comm_delay, count_comm_bytes
from shardkit.distributed import collectives as C
from shardkit.distributed.instrumentation import INSTRUMENTATION, CheckState, LinkModel, ScopeStack
from shardkit.testing import run_distributed


def _backward_on_thread(label: str) -> dict[str, Any]:
    """Run a backward pass on a new thread; a gradient hook all-reduces the gradient with ``label``."""
    weight = torch.ones(4, requires_grad=True)

    def reduce_grad(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        C.all_reduce(grad, label=label)
        return grad

    weight.register_hook(reduce_grad)
    outcome: dict[str, Any] = {}

    def run() -> None:
        start = time.perf_counter()
        try:
            (weight * 2.0).sum().backward()
        except Exception as err:
            outcome["error"] = err
        outcome["elapsed"] = time.perf_counter() - start
        outcome["grad"] = None if weight.grad is None else weight.grad.tolist()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return outcome


def _hooks_on_another_thread(rank: int, world_size: int) -> dict[str, Any]:
    with count_comm_bytes() as meter, comm_delay(latency_s=0.3), check_collectives(timeout_s=10):
        same = _backward_on_thread("hook.grad")
        differ = _backward_on_thread(f"hook.rank{rank}")
    return {
        "calls": dict(meter.calls),
        "wire": meter.total_wire_bytes,
        "elapsed": same["elapsed"],
        "grad": same["grad"],
        "same_error": repr(same.get("error")),
        "mismatch": isinstance(differ.get("error"), CollectiveMismatchError),
        "mismatch_text": str(differ.get("error")),
    }


def test_scopes_see_collectives_issued_from_another_thread() -> None:
    results = run_distributed(_hooks_on_another_thread, 2, timeout_s=60)
    for res in results:
        assert res["same_error"] == "None"
        assert res["grad"] == [4.0] * 4  # 2 per rank, summed over both ranks
        # the meter counted the hook's all-reduce (the refused one never ran)
        assert res["calls"] == {"all_reduce": 1}
        assert res["wire"] == int(2 * (1 / 2) * 16)
        # the simulated 0.3 s link slowed the hook's collective
        assert res["elapsed"] >= 0.3
        # the collective check compared the two ranks' hook collectives and refused the differing labels
        assert res["mismatch"], res["mismatch_text"]
        assert "hook.rank1" in res["mismatch_text"]


def test_scope_stack_nests_and_closes_out_of_order() -> None:
    stack: ScopeStack[str] = ScopeStack()
    assert stack.current() is None
    outer = stack.opened("outer")
    inner = stack.opened("inner")
    outer.__enter__()
    inner.__enter__()
    assert stack.current() == "inner"
    outer.__exit__(None, None, None)  # a scope on another thread may close first
    assert stack.current() == "inner"
    inner.__exit__(None, None, None)
    assert stack.current() is None


def test_meter_is_process_wide_and_thread_safe() -> None:
    with count_comm_bytes() as meter:
        assert INSTRUMENTATION.meters.current() is meter
        seen: list[Any] = []
        probe = threading.Thread(target=lambda: seen.append(INSTRUMENTATION.meters.current()))
        probe.start()
        probe.join()
        assert seen == [meter]

        def record_many() -> None:
            for _ in range(2000):
                meter.record("all_reduce", 3, 5.0)

        threads = [threading.Thread(target=record_many) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert INSTRUMENTATION.meters.current() is None
    assert meter.calls["all_reduce"] == 8000
    assert meter.total_payload_bytes == 24000 and meter.total_wire_bytes == 40000
    meter.reset()
    assert meter.total_wire_bytes == 0 and isinstance(meter, CommMeter)


def test_scope_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="latency_s >= 0"):
        LinkModel(-1.0, None)
    with pytest.raises(ValueError, match="bytes_per_s > 0"), comm_delay(0.0, bytes_per_s=0.0):
        pass
    with pytest.raises(ValueError, match="timeout_s > 0"):
        CheckState(0.0)
