"""torch.compile of stage modules under every pipeline schedule, and a custom autograd.Function whose backward
makes the weight gradient at once (issue 26 items 3 and 6): training equals single-process training, the split
schedules run such a stage's backward unsplit (with one warning naming the node), and a compiled module smp
cannot route is refused on every rank before anything runs. Kept tiny: compiling is slow on CPU."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit.models import ScaleWithWeightGrad

SCHEDULES: dict[str, dict[str, Any]] = {
    "simple": {"pipeline": "simple"},
    "interleaved": {"pipeline": "interleaved"},
    "zero_bubble": {"pipeline": "zero_bubble"},
    "zero_bubble_h2": {"pipeline": "zero_bubble_h2"},
    "virtual_stages": {"pipeline": "interleaved", "virtual_stages": 2},
    "zbv": {"pipeline": "zbv"},
    "dualpipev": {"pipeline": "dualpipev"},  # most backwards run whole there (fused_backwards), some split
}
#: Schedules whose backward is split into B and W (where a compiled or custom node forces it unsplit).
SPLIT = {"zero_bubble", "zero_bubble_h2", "zbv", "dualpipev"}
STEPS = 2
TOL = 1e-5


class Block(nn.Module):
    """A linear layer, tanh, and (``custom``) a learned scale through :class:`~testkit.models.ScaleWithWeightGrad`."""

    def __init__(self, fan_in: int, fan_out: int, custom: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(fan_in, fan_out)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, fan_out)) if custom else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(h))
        return ScaleWithWeightGrad.apply(h, self.scale) if self.scale is not None else h


def _net(custom: bool = False) -> nn.Sequential:
    """Four blocks: one per chunk of 2 ranks x 2 virtual stages."""
    torch.manual_seed(3)
    return nn.Sequential(Block(8, 16, custom), Block(16, 16, custom), Block(16, 16, custom), Block(16, 4, custom))


def _compile_blocks(net: nn.Sequential) -> nn.Module:
    """What a user writes: each block replaced by ``torch.compile(block)`` before ``smp.DistributedModel``."""
    for i, block in enumerate(net):
        net[i] = torch.compile(block, backend="aot_eager")
    return net


def _compile_in_place(net: nn.Sequential) -> nn.Module:
    for block in net:
        block.compile(backend="aot_eager")
    return net


MODELS: dict[str, Callable[[], nn.Module]] = {
    "compiled": lambda: _compile_blocks(_net()),
    "compiled_in_place": lambda: _compile_in_place(_net()),
    "custom_function": lambda: _net(custom=True),
    "compiled_whole": lambda: torch.compile(_net(), backend="aot_eager"),
    "compiled_checkpointed": lambda: _compile_blocks(_net()),
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)


def _plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The names of the uncompiled model (``torch.compile``'s wrapper adds ``_orig_mod.``)."""
    return {k.replace("_orig_mod.", ""): v for k, v in state.items()}


def _reference(custom: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _net(custom)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@smp.step
def _step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def _train(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    """Train each (model, schedule) of ``cases`` in turn; its results, or the ValueError it raised."""
    out: dict[tuple[str, str], Any] = {}
    for model_name, name in cases:
        torch._dynamo.reset()  # each case compiles its own fresh blocks, and counts its own graphs
        torch._dynamo.utils.counters.clear()
        smp.init({"partitions": 2, "microbatches": 4, **SCHEDULES[name]})
        try:
            net = MODELS[model_name]()
            if model_name == "compiled_checkpointed":
                smp.set_activation_checkpointing(net[1])  # the wrapper, whose forward checkpointing cannot replace
            model = smp.DistributedModel(net)
            opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
            losses = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for s in range(STEPS):
                    opt.zero_grad()
                    losses.append(_step(model, *_batch(s)).reduce_mean().item())
                    opt.step()
            out[model_name, name] = {
                "losses": losses,
                "state": _plain(model.state_dict()),
                "unsplit": [str(w.message) for w in caught if "unsplit" in str(w.message)],
                "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            }
        except ValueError as exc:
            out[model_name, name] = {"error": str(exc)}
        finally:
            smp.reset()
    return out


def _assert_trains_as_one_process(results: list[dict[tuple[str, str], Any]], model: str, node: str) -> None:
    ref_losses, ref_state = _reference(custom=model == "custom_function")
    for name in SCHEDULES:
        unsplit = []
        for per_rank in results:
            r = per_rank[model, name]
            assert "error" not in r, (name, r)
            assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) <= TOL, (name, r["losses"], ref_losses)
            assert max((r["state"][k] - v).abs().max().item() for k, v in ref_state.items()) <= TOL, name
            assert len(r["unsplit"]) <= 1, (name, r["unsplit"])  # one warning per stage, not per micro-batch
            unsplit += r["unsplit"]
        if name in SPLIT:  # the stages receiving inputs run unsplit, saying why
            assert unsplit and all(node in w for w in unsplit), (name, unsplit)
        else:
            assert unsplit == [], (name, unsplit)


def test_compiled_blocks_train_as_one_process_under_every_schedule() -> None:
    """``model[i] = torch.compile(block)`` (and ``block.compile()``): every schedule trains exactly; a compiled
    block's backward is one node producing input and weight gradients together, so the split schedules run
    that stage unsplit."""
    cases = [("compiled", name) for name in SCHEDULES] + [("compiled_in_place", "zero_bubble")]
    results = run_distributed(_train, 2, cases)
    _assert_trains_as_one_process(results, "compiled", node="CompiledFunctionBackward")
    ref_losses, ref_state = _reference(custom=False)
    for per_rank in results:
        assert all(r["graphs"] >= 1 for r in per_rank.values())  # the blocks really ran compiled
        r = per_rank["compiled_in_place", "zero_bubble"]
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) <= TOL
        assert max((r["state"][k] - v).abs().max().item() for k, v in ref_state.items()) <= TOL


def test_custom_function_with_weight_gradient_trains_as_one_process_under_every_schedule() -> None:
    """Item 6: a Function whose backward returns the weight's gradient with the input's runs unsplit, exactly."""
    results = run_distributed(_train, 2, [("custom_function", name) for name in SCHEDULES])
    _assert_trains_as_one_process(results, "custom_function", node="ScaleWithWeightGradBackward")


def test_compiled_modules_smp_cannot_route_are_refused_on_every_rank() -> None:
    """``torch.compile(model)`` over both stages, and a compiled block given to activation checkpointing: a
    ValueError on every rank in the first step, before anything ran, saying what to change."""
    cases = [("compiled_whole", "interleaved"), ("compiled_whole", "zbv"), ("compiled_checkpointed", "zero_bubble")]
    for per_rank in run_distributed(_train, 2, cases):
        for case in cases[:2]:
            error = per_rank[case]["error"]
            assert "children sit on different pipeline stages" in error and "torch.compile(model.blocks[i])" in error
        error = per_rank[cases[2]]["error"]
        assert "both compiled and given to smp.set_activation_checkpointing" in error
