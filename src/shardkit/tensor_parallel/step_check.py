"""Refuse an optimizer step that would split a tensor-parallel model's replicated parameters apart.

The ranks of one tensor-parallel group hold the same replicated parameters (layer norms, biases added after a
reduction, position tables) and compute the same gradients for them. Anything that scales those gradients by a
rank-local amount breaks that silently: the usual case is ``torch.nn.utils.clip_grad_norm_`` on a tensor-parallel
model, which sums each rank's own slices, so the ranks find different norms and, once clipping acts, different
factors. From that step on each rank holds a different model and training goes on without a word.

A global optimizer step pre-hook (torch's ``register_optimizer_step_pre_hook``), installed with this package, runs
before every ``step()`` of an optimizer that holds split parameters of one tensor-parallel group: the ranks
all-gather a four-number summary of the replicated parameters' gradients and, when two differ, every rank raises
before anything is updated, naming the parameter and the fix (``shardkit.tensor_parallel.clip_grad_norm_``, or the
clipping of FSDP or OSS, count each split parameter once). Differences below :data:`RTOL` (relative) pass: CUDA's
atomic reductions (an embedding's backward) may differ in the last bits between ranks.

Cost: nothing for optimizers without split parameters; otherwise one all-gather of four numbers per step (and a
second one, of two numbers per replicated parameter, only to name the parameter that differs). Set
``SHARDKIT_TP_STEP_CHECK=0`` to switch it off. ``shardkit plan`` and ``shardkit bench tp`` count the algorithm's
bytes without it (:func:`suspended`); the benchmark's timed steps include it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardkit.distributed.rehearsal import rehearsing
from shardkit.tensor_parallel.checks import gather_rows
from shardkit.tensor_parallel.grad_norm import split_groups
from shardkit.tensor_parallel.sharding import modules_with_splits

#: Relative difference of a gradient summary below which the ranks count as agreeing.
RTOL = 1e-5
ENV = "SHARDKIT_TP_STEP_CHECK"
LABEL = "tp.check_step"
_EXEMPT = "_shardkit_tp_step_check_exempt"
_SUSPENDED: ContextVar[bool] = ContextVar("shardkit_tp_step_check_suspended", default=False)


@functools.cache
def install() -> None:
    """Register the step check (once per process)."""
    register_optimizer_step_pre_hook(check_step)


def exempt(optimizer: torch.optim.Optimizer) -> None:
    """Never check ``optimizer``: the inner optimizer of a wrapper whose own step is checked (OSS's)."""
    optimizer.__dict__[_EXEMPT] = True


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No step check inside (on this thread): for a benchmark that counts the bytes of the algorithm alone."""
    token = _SUSPENDED.set(True)
    try:
        yield
    finally:
        _SUSPENDED.reset(token)


def check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Raise on every rank of the tensor-parallel group when ``optimizer`` is about to step replicated parameters
    whose gradients differ between the ranks (see the module docstring)."""
    if not modules_with_splits() or optimizer.__dict__.get(_EXEMPT) or _SUSPENDED.get():
        return
    if os.environ.get(ENV, "1") == "0" or rehearsing():
        return
    params = [
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if isinstance(p, torch.Tensor) and p.grad is not None and not _is_dtensor(p)
    ]
    if not params:
        return
    groups = split_groups(params)
    tp_groups = {id(g): g for g in groups if g is not None}
    if len(tp_groups) != 1:  # no split parameter (not a tensor-parallel model), or several groups: not checked
        return
    tp_group = next(iter(tp_groups.values()))
    size = dist.get_world_size(tp_group)
    replicated = [p for p, g in zip(params, groups) if g is None]
    grads = [p.grad for p in replicated if p.grad is not None]  # all of them: params were kept for their gradients
    if not grads or grads[0].device.type == "meta":
        return
    stats = torch.stack([_stats(g) for g in grads])  # (n, 2): sum |g|, sum g
    weights = torch.arange(1, len(replicated) + 1, dtype=torch.float64, device=stats.device)
    summary = torch.stack(
        [stats.new_tensor(float(len(replicated))), stats[:, 0].sum(), weights @ stats[:, 0], weights @ stats[:, 1]]
    )
    rows = gather_rows(summary, tp_group, size, LABEL)
    if _agree(rows):
        return
    if not bool((rows[:, 0] == rows[0, 0]).all()):
        raise RuntimeError(_message("a different number of replicated parameters with gradients", None))
    per_param = gather_rows(stats.reshape(-1), tp_group, size, LABEL).view(size, len(replicated), 2)
    index = next(i for i in range(len(replicated)) if not _agree(per_param[:, i]))
    position = next(
        (g, k)
        for g, group in enumerate(optimizer.param_groups)
        for k, p in enumerate(group["params"])
        if p is replicated[index]
    )
    raise RuntimeError(_message(f"param_groups[{position[0]}]['params'][{position[1]}]", replicated[index]))


def _is_dtensor(p: torch.Tensor) -> bool:
    return type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor"


def _stats(grad: torch.Tensor) -> torch.Tensor:
    g = grad.detach().to(torch.float64)
    return torch.stack([g.abs().sum(), g.sum()])


def _agree(rows: torch.Tensor) -> bool:
    return bool(torch.isclose(rows, rows[0].expand_as(rows), rtol=RTOL, atol=0.0, equal_nan=True).all())


def _message(what: str, param: Any) -> str:
    shape = f" (shape {tuple(param.shape)})" if param is not None else ""
    return (
        f"optimizer.step() refused: {what}{shape}: replicated parameters have different gradients on the "
        "tensor-parallel ranks, so this step would leave each rank a different model. Usual causes: a gradient clip "
        "that counts each rank's own slices as whole tensors (torch.nn.utils.clip_grad_norm_ on a tensor-parallel "
        "model): use shardkit.tensor_parallel.clip_grad_norm_(model, max_norm) (or FSDP's clip_grad_norm_, or "
        "OSS.clip_grad_norm), which count each split parameter once; a replicated parameter applied to "
        "sequence-split activations (sequence_parallel=True) without copy_to_tp(param), so each rank has only its "
        "own tokens' gradient; dropout or other randomness seeded differently on the tensor-parallel ranks (seed "
        f"with model_parallel_manual_seed). {ENV}=0 switches this check off."
    )
