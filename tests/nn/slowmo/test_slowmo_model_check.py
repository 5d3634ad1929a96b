"""Ranks that built different models, or refused their arguments on some ranks only, fail at construction on
every rank, with the parameter and ranks named, and nothing is broadcast or changed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.model_check import TensorSignature, describe_mismatch, model_signature
from shardkit.nn.data_parallel import SlowMoDistributedDataParallel
from shardkit.testing import run_distributed


class Net(nn.Module):
    def __init__(self, hidden: int = 8, frozen_bias: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, 2)
        if frozen_bias:
            self.fc2.bias.requires_grad_(False)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _try_wrap(rank: int, world_size: int, variant: str) -> dict[str, Any]:
    torch.manual_seed(100 + rank)  # different values on every rank: a broadcast would show
    kwargs: dict[str, Any] = {}
    if variant == "shape":
        model = Net(hidden=8 if rank == 0 else 6)
    elif variant == "requires_grad":
        model = Net(frozen_bias=rank == 1)
    elif variant == "argument":  # a bad argument on rank 1 only
        model = Net()
        kwargs["slowmo_frequency"] = 6 if rank == 0 else 0
    else:
        raise AssertionError(variant)
    before = _state(model)
    try:
        SlowMoDistributedDataParallel(model, 1, **kwargs)
        error = None
    except ValueError as exc:
        error = str(exc)
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # The group is still usable afterwards: no rank is stuck inside a half-issued collective.
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe)
    return dict(error=error, unchanged=unchanged, probe=probe.item())


@pytest.mark.parametrize("variant", ["shape", "requires_grad", "argument"])
def test_every_rank_raises_and_nothing_changes(variant: str) -> None:
    results = run_distributed(_try_wrap, 2, variant, timeout_s=60)
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} did not raise"
        assert result["unchanged"], f"rank {rank}'s model was modified"
        assert result["probe"] == 3.0
    if variant == "shape":
        for result in results:
            message = result["error"]
            assert "different models" in message and "'fc1.weight'" in message
            assert "rank 0" in message and "rank 1" in message and "[8, 4]" in message and "[6, 4]" in message
    if variant == "requires_grad":
        assert all("'fc2.bias'" in r["error"] and "frozen" in r["error"] for r in results)
    if variant == "argument":
        assert "slowmo_frequency" in results[1]["error"]  # rank 1 raises its own error
        assert "rank 1 refused its arguments" in results[0]["error"] and "slowmo_frequency" in results[0]["error"]


def test_describe_mismatch_names_the_first_difference() -> None:
    a = model_signature(Net())
    assert describe_mismatch(a, model_signature(Net()), 0, 1) is None
    renamed = [s._replace(name="other") if s.name == "bn.weight" else s for s in a]
    problem = describe_mismatch(a, renamed, 0, 3)
    assert problem is not None and "'bn.weight'" in problem and "'other'" in problem and "rank 3" in problem
    extra = a + [TensorSignature("buffer", "extra", (1,), "torch.float32", False)]
    problem = describe_mismatch(a, extra, 0, 2)
    assert problem is not None and "buffer 'extra' [1] torch.float32 exists only on rank 2" in problem
    assert [s.kind for s in a].count("buffer") == 3  # running_mean, running_var, num_batches_tracked
    assert not any(s.kind == "buffer" for s in model_signature(Net(), buffers=False))
