"""Shared pieces of the ShardedDataParallel tests: a torch DDP reference trained side by side with OSS+SDP (models,
batches and gradient averaging come from ``testkit``)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.nn import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing.models import loss_for
from testkit import OPTIMIZERS, average_grads, max_param_diff, rank_batch, tiny_model


@dataclass
class Scenario:
    """One side-by-side training run; every field is a way the trainable set or the step can vary."""

    model: str = "lm"
    optim: str = "sgd"
    steps: int = 3
    accumulate: int = 1
    freeze: bool = False  # freeze the first half of the parameter tensors from the start
    flip_at: Optional[int] = None  # step at which a trainable tensor freezes and a frozen one thaws
    unused: bool = False  # BranchyNet with a branch chosen per (rank, step); DDP needs find_unused_parameters
    two_optims: Optional[str] = None  # second optimizer for the second half of the parameters
    manual_refresh: bool = False  # call refresh_trainable() after the flip (with auto_refresh_trainable=False)
    sdp_kwargs: dict[str, Any] = field(default_factory=dict)


def _split(params: Sequence[nn.Parameter], two: bool) -> list[list[nn.Parameter]]:
    half = len(params) // 2
    return [list(params[:half]), list(params[half:])] if two else [list(params)]


def _optimizers(sc: Scenario, params: Sequence[nn.Parameter], sharded: bool) -> list[torch.optim.Optimizer]:
    names = [sc.optim, sc.two_optims] if sc.two_optims else [sc.optim]
    out: list[torch.optim.Optimizer] = []
    for chunk, name in zip(_split(params, sc.two_optims is not None), names):
        cls, kwargs = OPTIMIZERS[name]
        out.append(OSS(chunk, optim=cls, **kwargs) if sharded else cls(chunk, **kwargs))
    return out


def _flip(model: nn.Module) -> None:
    """Freeze the first trainable tensor and thaw the first frozen one (same on every rank)."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    trainable[0].requires_grad_(False)
    if frozen:
        frozen[0].requires_grad_(True)


@dataclass
class Outcome:
    """What a scenario measured on one rank."""

    param_diff: float = 0.0  # largest |reference - sharded| parameter gap after any step
    grad_diff: float = 0.0  # largest |reference - sharded| gradient gap on the owner after any synced backward
    grad_problems: list[str] = field(default_factory=list)  # gradients present where they should not be, or missing


def compare_grads(ref: nn.Module, sdp: ShardedDataParallel, rank: int, outcome: Outcome) -> None:
    """Owners hold the reference's averaged gradient (None where it is None); every other rank holds None."""
    owner_of: dict[torch.Tensor, int] = {}
    for optimizer in sdp.sharded_optimizers:
        owner_of.update(optimizer.param_to_rank)
    for (name, p), q in zip(ref.named_parameters(), sdp.module.parameters()):
        if q not in owner_of:
            if q.grad is not None:
                outcome.grad_problems.append(f"frozen {name} has a gradient")
            continue
        if owner_of[q] != rank:
            if q.grad is not None:
                outcome.grad_problems.append(f"rank {rank} keeps a gradient for {name}, owned by rank {owner_of[q]}")
            continue
        if (p.grad is None) != (q.grad is None):
            outcome.grad_problems.append(f"{name}: reference grad is None: {p.grad is None}, sharded: {q.grad is None}")
        elif p.grad is not None and q.grad is not None:
            outcome.grad_diff = max(outcome.grad_diff, (p.grad - q.grad).abs().max().item())


#: Parameters whose gradient is analytically zero, so the computed one is rounding noise whose value depends on the
#: order of the cross-rank sum (reduce vs ring all-reduce differ at 4 ranks). AdamW divides by the gradient's
#: magnitude and turns that noise into parameter differences up to lr, so AdamW scenarios freeze them. The
#: gradient comparison still covers them in the SGD scenarios.
NULL_GRADIENT = {
    "lm": ("qkv.bias",),  # the key bias: softmax ignores a constant added to every key
    "batchnorm": ("fc1.bias", "body.0.bias"),  # a bias right before BatchNorm is removed with the batch mean
}


def freeze_null_gradients(name: str, model: nn.Module) -> None:
    """Freeze the parameters of reference model ``name`` listed in :data:`NULL_GRADIENT`."""
    for param_name, p in model.named_parameters():
        if param_name.endswith(NULL_GRADIENT.get(name, ())):
            p.requires_grad_(False)


def _prepare(sc: Scenario) -> nn.Module:
    base = tiny_model("branchy" if sc.unused else sc.model)
    params = list(base.parameters())
    if sc.freeze or sc.flip_at is not None:
        for p in params[: len(params) // 2]:
            p.requires_grad_(False)
    if "adamw" in (sc.optim, sc.two_optims):
        freeze_null_gradients(sc.model, base)
    return base


def run_scenario(rank: int, sc: Scenario) -> Outcome:
    """Train a torch DDP reference and an OSS+ShardedDataParallel copy side by side, comparing every step."""
    base = _prepare(sc)
    ref_inner, sdp_inner = copy.deepcopy(base), copy.deepcopy(base)
    ref_opts = _optimizers(sc, list(ref_inner.parameters()), sharded=False)
    sdp_opts = _optimizers(sc, list(sdp_inner.parameters()), sharded=True)
    # torch DDP fixes its trainable set at construction (and a second DDP over the same module would leave the first
    # one's hooks behind), so when requires_grad flips the reference averages gradients by hand, as DDP would.
    ref: nn.Module = ref_inner if sc.flip_at is not None else DDP(ref_inner, find_unused_parameters=sc.unused)
    sdp = ShardedDataParallel(sdp_inner, sdp_opts if len(sdp_opts) > 1 else sdp_opts[0], **sc.sdp_kwargs)
    name = "branchy" if sc.unused else sc.model
    outcome = Outcome()
    for step in range(sc.steps):
        if step == sc.flip_at:
            _flip(ref_inner)
            _flip(sdp_inner)
            if sc.manual_refresh:
                sdp.refresh_trainable()
        for model in (ref, sdp):
            for micro in range(sc.accumulate):
                quiet = micro < sc.accumulate - 1 and model is not ref_inner
                with model.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[operator]
                    x, y = rank_batch(name, model, rank, step, micro)
                    kwargs = {"use_b": (rank + step) % 2 == 0} if sc.unused else {}
                    loss_for(name, model(x, **kwargs), y).backward()
        if ref is ref_inner:
            average_grads(ref_inner)
        compare_grads(ref_inner, sdp, rank, outcome)
        for opt in ref_opts + sdp_opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        outcome.param_diff = max(outcome.param_diff, max_param_diff(ref_inner, sdp_inner))
    return outcome
