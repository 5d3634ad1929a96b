"""``smp.set_activation_checkpointing`` across a 2-stage pipeline: the same training as one process, and the
marked modules' forwards really run twice (forward and recomputation) on the stage that owns them."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Optional

import pytest
import torch
from smp_testlib import CKPT_MICROBATCHES as MICROBATCHES
from smp_testlib import CKPT_STEPS as STEPS
from smp_testlib import PARITY_TOL as TOL
from smp_testlib import CkptBlock as Block
from smp_testlib import CkptNet as Net
from smp_testlib import ckpt_batch as _batch
from smp_testlib import ckpt_reference as _reference
from torch import nn

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit.smp import mse_step


def _mark(net: Net, scenario: str) -> None:
    if scenario == "blocks":
        for block in net.blocks:
            smp.set_activation_checkpointing(block)
    elif scenario == "sequential":  # spans both stages: its layers are checkpointed one by one
        smp.set_activation_checkpointing(net.blocks, strategy="contiguous")
        smp.set_activation_checkpointing(net.pre, strategy="group_2", pack_args_as_tuple=True)
    elif scenario == "whole":  # the root spans both stages
        smp.set_activation_checkpointing(net)


def _run(scenario: str, manual: bool) -> dict[str, Any]:
    smp.init({"partitions": 2, "microbatches": MICROBATCHES, "auto_partition": not manual})
    net = Net(manual=True)
    _mark(net, scenario)
    calls: Counter[str] = Counter()
    for name, module in net.named_modules():
        module.register_forward_pre_hook(lambda m, a, name=name: calls.update([name]))
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    losses: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(STEPS):
            x, y = _batch(s)
            opt.zero_grad()
            losses.extend(t.item() for t in mse_step(model, x, y).outputs)
            opt.step()
            if s == 0:  # the first step also traced and planned: count the later ones
                calls.clear()
    late = _error_of(lambda: smp.set_activation_checkpointing(net.head))
    classes = {name: type(m).__qualname__ for name, m in net.named_modules() if name}
    smp.reset()
    restored = all(type(m) in (nn.Sequential, nn.Linear, nn.Tanh, Block, Net) for m in net.modules())
    return {
        "losses": losses,
        "calls": dict(calls),
        "warnings": [str(w.message) for w in caught if "set_activation_checkpointing" in str(w.message)],
        "late": late,
        "classes": classes,
        "restored": restored,
    }


def _error_of(call: Any) -> str:
    try:
        call()
    except Exception as exc:  # asserted on by type and text
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    for scenario, manual in (("none", True), ("blocks", True), ("sequential", True), ("whole", False)):
        out[scenario] = _run(scenario, manual)
    out["whole_manual"] = _error_of(lambda: _run("whole", True))
    smp.reset()
    return out


def _per_step(calls: dict[str, int], name: str) -> Optional[float]:
    return calls.get(name, 0) / ((STEPS - 1) * MICROBATCHES)


def test_checkpointed_modules_recompute_and_train_like_one_process() -> None:
    reference = _reference()
    per_rank = run_distributed(_scenarios, 2)
    for rank, result in enumerate(per_rank):
        for scenario in ("none", "blocks", "sequential", "whole"):
            r = result[scenario]
            diff = max(abs(a - b) for a, b in zip(r["losses"], reference))
            assert len(r["losses"]) == len(reference) and diff <= TOL, (rank, scenario, diff)
            assert r["late"].startswith("RuntimeError") and "before the first" in r["late"], r["late"]
            assert r["restored"], (rank, scenario, "smp.reset left a changed class behind")
        # The layer inside each block: one forward per micro-batch, plus one recomputation when checkpointed.
        mine = ["blocks.0.lin", "blocks.1.lin"] if rank == 0 else ["blocks.2.lin", "blocks.3.lin"]
        for name in mine:
            assert _per_step(result["none"]["calls"], name) == 1.0, (rank, result["none"]["calls"])
            assert _per_step(result["blocks"]["calls"], name) == 2.0, (rank, result["blocks"]["calls"])
            assert _per_step(result["sequential"]["calls"], name) == 2.0, (rank, result["sequential"]["calls"])
        # Spanning stages under auto-partition: nothing is recomputed anywhere.
        assert all(_per_step(result["whole"]["calls"], n) == 1.0 for n in result["whole"]["calls"]), result["whole"]
        if rank == 0:  # pre runs on stage 0 as one unit: group_2 recomputes its layers in pairs
            for layer in ("pre.0", "pre.1", "pre.2", "pre.3"):
                assert _per_step(result["sequential"]["calls"], layer) == 2.0, result["sequential"]["calls"]
            assert result["sequential"]["classes"]["pre"] == "Sequential"
        assert result["whole"]["warnings"] and "runs without checkpointing" in result["whole"]["warnings"][0]
        assert (
            result["whole_manual"].startswith("ValueError") and "different pipeline stages" in result["whole_manual"]
        ), result["whole_manual"]


def test_bad_arguments_are_refused() -> None:
    smp.init({"partitions": 1})
    try:
        with pytest.raises(ValueError, match=r"nn\.Sequential only"):
            smp.set_activation_checkpointing(nn.Linear(2, 2), strategy="contiguous")
        with pytest.raises(ValueError, match="group_<n>"):
            smp.set_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), strategy="group_0")
        with pytest.raises(TypeError):
            smp.set_activation_checkpointing("not a module")  # type: ignore[arg-type]
    finally:
        smp.reset()
