"""smp's state is process-wide: every thread sees what ``smp.init`` set (a ContextVar hid it from other threads)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardkit.modelparallel as smp


def _in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a fresh thread (no copied context) and return its result or raise its error."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the test thread
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_rank_helpers_answer_in_another_thread(single: None) -> None:
    seen = _in_thread(
        lambda: (
            smp.is_initialized(),
            smp.rank(),
            smp.size(),
            smp.local_rank(),
            smp.local_size(),
            smp.mp_rank(),
            smp.mp_size(),
            smp.dp_rank(),
            smp.dp_size(),
            smp.pp_size(),
            smp.get_mp_group(),
            smp.get_dp_group(),
        )
    )
    assert seen == (True, 0, 1, 0, 1, 0, 1, 0, 1, 1, [0], [0])


def test_reset_in_one_thread_is_seen_by_another() -> None:
    smp.reset()
    smp.init({"partitions": 1})
    _in_thread(smp.reset)
    assert not smp.is_initialized()
    with pytest.raises(RuntimeError, match=r"call smp.init\(\)"):
        smp.rank()


def test_step_runs_in_a_thread_other_than_inits(single: None) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    reference = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    reference.load_state_dict(net.state_dict())
    model = smp.DistributedModel(net)
    x, y = torch.randn(6, 4), torch.randn(6, 1)

    @smp.step
    def train_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    loss = _in_thread(lambda: train_step(model, x, y).reduce_mean())
    # Two micro-batches, gradients averaged over them: the same as the whole batch at once.
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for (name, ours), theirs in zip(model.module.named_parameters(), reference.parameters()):
        assert ours.grad is not None, name
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)
