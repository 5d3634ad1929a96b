"""What an ``@smp.step`` function returns: one value per micro-batch for every leaf, the output stage's on
every rank.

Tensors become ``StepOutput``; every other leaf (a Python number from ``loss.item()``, a count, a string,
``None``) becomes a list of its per-micro-batch values, inside the structure the function returned. The
multi-process tests train a pipeline of 2 and 4 stages and compare every returned value on every rank with the
same values computed in one process.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardkit.modelparallel as smp
from shardkit.modelparallel.step import gather_microbatch_outputs
from shardkit.testing import run_distributed
from testkit.smp import new_mse_step

MICROBATCHES = 4
BATCH = 16
STEPS = 2
TOL = 1e-5


def _classifier() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(BATCH, 8, generator=gen), torch.randint(0, 4, (BATCH,), generator=gen)


def _metrics(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float, int, dict[str, Any]]:
    """What a real script returns: the loss tensor, ``loss.item()``, a correct-count, a dict of assorted leaves."""
    loss = F.cross_entropy(logits, y)
    correct = int((logits.argmax(dim=1) == y).sum().item())
    extra = {
        "loss": loss.item(),
        "top": [int(logits.argmax(dim=1)[0].item()), "tag"],
        "nothing": None,
        "pair": (correct * 2, loss.detach() * 2),
        # Its shape depends on the values: a stage computing from placeholder zeros would get an empty tensor.
        "positive": logits[logits > 0].detach(),
    }
    return loss, loss.item(), correct, extra


@smp.step
def _train_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> Any:
    logits = model(x)
    out = _metrics(logits, y)
    model.backward(out[0])
    return out


def _reference() -> list[dict[str, Any]]:
    """Every step's per-micro-batch values in one process (the gradient averaged over micro-batches)."""
    model = _classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        per_mb = [_metrics(model(xm), ym) for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))]
        (sum(m[0] for m in per_mb) / MICROBATCHES).backward()
        opt.step()
        steps.append(_flatten_reference(per_mb))
    return steps


def _flatten_reference(per_mb: list[Any]) -> dict[str, Any]:
    return {
        "loss_tensor": [m[0].item() for m in per_mb],
        "loss_item": [m[1] for m in per_mb],
        "correct": [m[2] for m in per_mb],
        "dict_loss": [m[3]["loss"] for m in per_mb],
        "dict_top": [m[3]["top"][0] for m in per_mb],
        "dict_tag": [m[3]["top"][1] for m in per_mb],
        "dict_none": [m[3]["nothing"] for m in per_mb],
        "dict_pair0": [m[3]["pair"][0] for m in per_mb],
        "dict_pair1": [m[3]["pair"][1].item() for m in per_mb],
        "dict_positive": [m[3]["positive"].sum().item() for m in per_mb],
    }


def _flatten_smp(result: Any) -> dict[str, Any]:
    loss, loss_item, correct, extra = result
    assert isinstance(loss, smp.StepOutput) and isinstance(extra["pair"][1], smp.StepOutput)
    for leaf in (loss_item, correct, extra["loss"], extra["top"][0], extra["top"][1], extra["nothing"]):
        assert type(leaf) is list, f"a non-tensor leaf came back as {type(leaf).__name__}, not a per-micro-batch list"
    assert isinstance(extra["pair"], tuple) and isinstance(extra["top"], list)
    return {
        "loss_tensor": [t.item() for t in loss.outputs],
        "loss_item": loss_item,
        "correct": correct,
        "dict_loss": extra["loss"],
        "dict_top": extra["top"][0],
        "dict_tag": extra["top"][1],
        "dict_none": extra["nothing"],
        "dict_pair0": extra["pair"][0],
        "dict_pair1": [t.item() for t in extra["pair"][1].outputs],
        "dict_positive": [t.sum().item() for t in extra["positive"].outputs],
    }


def _pipeline_outputs(rank: int, world_size: int, pipeline: str) -> list[dict[str, Any]]:
    smp.init({"partitions": world_size, "microbatches": MICROBATCHES, "pipeline": pipeline})
    model = smp.DistributedModel(_classifier())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    steps = []
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        steps.append(_flatten_smp(_train_step(model, x, y)))
        opt.step()
    local = sum(p.numel() for p in model.local_parameters())
    total = sum(p.numel() for p in _classifier().parameters())
    assert local < total, "the model was not split: this test needs stages without the model's output"
    smp.reset()
    return steps


def _assert_close(name: str, got: list[Any], want: list[Any], where: str) -> None:
    assert len(got) == len(want) == MICROBATCHES, f"{where} {name}: {len(got)} values, want {MICROBATCHES}"
    for mb, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, float):
            assert isinstance(g, float) and abs(g - w) <= TOL, f"{where} {name} micro-batch {mb}: {g} != {w}"
        else:
            assert type(g) is type(w) and g == w, f"{where} {name} micro-batch {mb}: {g!r} != {w!r}"


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("pipeline", ["interleaved", "simple"])
def test_every_returned_leaf_matches_single_process_on_every_rank(stages: int, pipeline: str) -> None:
    """loss.item(), a correct-count, a dict of numbers/strings/None/tensors: per micro-batch, on every stage."""
    reference = _reference()
    per_rank = run_distributed(_pipeline_outputs, stages, pipeline)
    # A test that can fail: the micro-batches' values differ, so returning micro-batch 0's for all would not pass.
    assert len(set(reference[0]["loss_item"])) == MICROBATCHES
    for rank, steps in enumerate(per_rank):
        for s, (got, want) in enumerate(zip(steps, reference)):
            for name in want:
                _assert_close(name, got[name], want[name], f"rank {rank} step {s}")


@smp.step
def _positive_only(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return logits[logits > 0]  # its shape depends on the output's values; placeholders elsewhere give another


def _tensor_only_shapes(rank: int, world_size: int) -> list[list[float]]:
    smp.init({"partitions": world_size, "microbatches": MICROBATCHES})
    model = smp.DistributedModel(_classifier())
    sums = []
    with torch.no_grad():
        for s in range(STEPS):
            out = _positive_only(model, _batch(s)[0])
            sums.append([t.sum().item() for t in out.outputs])
    smp.reset()
    return sums


def test_tensor_whose_shape_depends_on_the_output_is_the_output_stages_everywhere() -> None:
    model = _classifier()
    with torch.no_grad():
        want = [[m[m > 0].sum().item() for m in model(_batch(s)[0]).chunk(MICROBATCHES)] for s in range(STEPS)]
    for rank, got in enumerate(run_distributed(_tensor_only_shapes, 2)):
        for s in range(STEPS):
            assert max(abs(a - b) for a, b in zip(got[s], want[s])) <= TOL, (rank, s, got[s], want[s])


# ---- the gathering alone (no processes) ---------------------------------------------------------------------


def test_gather_wraps_tensors_and_lists_every_other_leaf() -> None:
    per_mb = [(torch.tensor(float(k)), k, {"s": f"mb{k}", "n": None}) for k in range(3)]
    loss, count, extra = gather_microbatch_outputs(per_mb)
    assert isinstance(loss, smp.StepOutput) and loss.reduce_sum().item() == 3.0
    assert count == [0, 1, 2]
    assert extra == {"s": ["mb0", "mb1", "mb2"], "n": [None, None, None]}


def test_gather_returns_a_list_for_a_bare_number_and_none() -> None:
    assert gather_microbatch_outputs([1.5, 2.5]) == [1.5, 2.5]
    assert gather_microbatch_outputs([None, None]) == [None, None]


def test_gather_refuses_outputs_whose_structure_differs_between_microbatches() -> None:
    with pytest.raises(ValueError, match="micro-batch 1"):
        gather_microbatch_outputs([{"a": 1}, {"b": 1}])
    with pytest.raises(ValueError, match="tensor in micro-batch 0"):
        gather_microbatch_outputs([torch.tensor(1.0), 1.0])


def _models_one_after_another(rank: int, world_size: int, models: int) -> list[list[float]]:
    """One step function over several models in turn. Rank 1 sees every model at the same ``id`` (as when a freed
    model's memory is reused for the next one, which CPython does by chance): nothing may depend on it."""
    if rank == 1:
        # Shadows the builtin inside the module (``smp.step`` the attribute is the decorator, not the module).
        importlib.import_module("shardkit.modelparallel.step").id = lambda obj: 0
    step = new_mse_step()
    losses, kept = [], []
    for _ in range(models):
        smp.init({"partitions": world_size, "microbatches": MICROBATCHES})
        model = smp.DistributedModel(_classifier())
        x, y = _batch(0)
        losses.append([t.item() for t in step(model, x, F.one_hot(y, 4).float()).outputs])
        kept.append(model)  # rank 0's models keep their distinct ids
        smp.reset()
    return losses


def test_a_new_model_is_checked_afresh_even_where_an_old_ones_memory_is_reused() -> None:
    """The first-call check of a step's outputs belongs to the model object: keyed by ``id(model)``, a rank that
    reused a freed model's address skipped the check the other rank made, and the two waited in different
    collectives until the job was killed."""
    per_rank = run_distributed(_models_one_after_another, 2, 3, timeout_s=60)
    assert per_rank[0] == per_rank[1]
    assert per_rank[0][0] == per_rank[0][1] == per_rank[0][2]  # the same start and batch: the same losses


@smp.step
def _returns_a_lambda(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> Any:
    loss = F.cross_entropy(model(x), y)
    model.backward(loss)
    return loss, {"scale": lambda v: v * 2}


def _unsendable_output(rank: int, world_size: int) -> str:
    smp.init({"partitions": world_size, "microbatches": 2})
    model = smp.DistributedModel(_classifier())
    try:
        _returns_a_lambda(model, *_batch(0))
    except TypeError as err:
        return str(err)
    finally:
        smp.reset()
    return "returned"


def test_an_output_that_cannot_be_sent_is_refused_on_every_stage() -> None:
    for message in run_distributed(_unsendable_output, 2, timeout_s=90):
        assert "the @smp.step function returned <function _returns_a_lambda.<locals>.<lambda>" in message, message
        assert "(a function) at micro-batch 0, result[1]['scale']" in message
        assert "cannot be sent from the output stage" in message
