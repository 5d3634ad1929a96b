"""torch.compile of wrapped models: the units' hooks run eagerly, the compute between them is compiled, and
training equals eager FSDP; fullgraph=True fails at once saying which modes work. Kept tiny: compiling is slow
on CPU."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from shardkit.distributed import DummyProcessGroup
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP

ONE = DummyProcessGroup(rank=0, size=1)
# bfloat16 compute keeps a separate full copy per unit even with one rank (the path that resizes storages).
SETTINGS: dict[str, Any] = {"process_group": ONE, "mixed_precision": True, "compute_dtype": torch.bfloat16}


def _nested(compile_inner: Callable[[nn.Module], nn.Module] = lambda m: m) -> FSDP:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    layers[0] = FSDP(compile_inner(layers[0]), **SETTINGS)
    return FSDP(layers, **SETTINGS)


def _train(model: FSDP, run: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[float], list[torch.Tensor]]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
        loss = run(x).float().square().sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _assert_same(got: tuple[list[float], list[torch.Tensor]], want: tuple[list[float], list[torch.Tensor]]) -> None:
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)


def test_compiled_nested_model_trains_like_eager() -> None:
    want = _train(model := _nested(), model)
    counters.clear()
    model = _nested()
    _assert_same(_train(model, torch.compile(model)), want)  # default backend (inductor)
    assert counters["stats"]["unique_graphs"] >= 1  # something was compiled, not all skipped


def test_blocks_compiled_before_wrapping_train_like_eager() -> None:
    want = _train(model := _nested(), model)
    counters.clear()
    model = _nested(lambda block: torch.compile(block, backend="aot_eager"))
    _assert_same(_train(model, model), want)
    assert counters["stats"]["unique_graphs"] >= 1


def test_fullgraph_fails_at_once_naming_the_modes_that_work() -> None:
    model = _nested()
    with pytest.raises(Exception, match=r"runs its gather/free hooks eagerly.*fullgraph=False"):
        torch.compile(model, fullgraph=True, backend="eager")(torch.randn(2, 4))
    _train(model, model)  # the failed attempt left the model usable
