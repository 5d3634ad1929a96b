"""Shared pieces of the FSDP tests: build a reference model and an FSDP model side by side, train, compare (batches,
the training step and gradient averaging come from ``testkit``)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.testing import models as M
from testkit import average_grads, model_batch, train_step

LR = 0.05
BATCH = 4


def build_reference(name: str, rank: int) -> nn.Module:
    """The unwrapped model, seeded like :func:`build_fsdp` builds it."""
    torch.manual_seed(0)
    kwargs = {"expert_seed": rank} if name == "moe" else {}
    return M.build(name, seed=0, **kwargs)


def build_fsdp(name: str, rank: int, world_size: int, nested: bool, **fsdp_kwargs: Any) -> FSDP:
    """The same model wrapped in FSDP; ``nested`` also wraps inner pieces in their own instances.

    The mixture-of-experts model always wraps its expert in an FSDP instance over a size-one group (one per
    rank, created on every rank as ``new_group`` requires).
    """

    def inner(module: nn.Module) -> nn.Module:
        return FSDP(module, **fsdp_kwargs)

    offload = fsdp_kwargs.get("cpu_offload") or fsdp_kwargs.get("move_params_to_cpu")
    if offload and "compute_device" not in fsdp_kwargs:
        # Offload computes on the rank's GPU when there is one; these CPU parity tests mean the host everywhere.
        fsdp_kwargs = {**fsdp_kwargs, "compute_device": torch.device("cpu")}
    wrap_fn: Callable[[nn.Module], nn.Module] = inner if nested else (lambda m: m)
    kwargs: dict[str, Any] = {}
    if name == "moe":
        groups = [dist.new_group([r]) for r in range(world_size)] if dist.is_initialized() else [None]
        kwargs = {
            "expert_seed": rank,
            "wrap_fn": wrap_fn,
            "expert_wrap_fn": lambda m: FSDP(m, process_group=groups[rank], **fsdp_kwargs),
        }
    elif name in ("nested", "batchnorm"):
        kwargs = {"wrap_fn": wrap_fn}
    model = M.build(name, seed=0, **kwargs)
    if name == "lm" and nested:
        # TransformerLM re-initialises its parameters after building its blocks, so wrap blocks afterwards.
        assert isinstance(model, M.TransformerLM)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = inner(block)
    return FSDP(model, **fsdp_kwargs)


def ddp_reference(name: str, model: nn.Module) -> nn.Module:
    """DDP over the reference model; expert parameters are excluded from DDP's reduction."""
    if name == "moe":
        assert isinstance(model, M.MixtureOfExperts)
        DDP._set_params_and_buffers_to_ignore_for_model(model, model.expert_parameter_names())
    return DDP(model, broadcast_buffers=False)


def step(
    name: str,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    rank: int,
    step_i: int,
    micro_batches: int = 1,
    no_sync: Optional[Callable[[], Any]] = None,
) -> float:
    """One optimizer step over ``micro_batches`` backward passes; ``no_sync`` skips communication for all but
    the last. Each rank sees its own data. Returns the summed loss."""

    def batch_of(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return model_batch(name, model, 1000 * step_i + 10 * micro + rank, BATCH)

    return train_step(model, optim, batch_of, micro_batches, lambda out, y: M.loss_for(name, out, y), no_sync=no_sync)


def full_params(model: FSDP) -> dict[str, torch.Tensor]:
    """Full parameters under their original names (copies)."""
    with model.summon_full_params(writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_params(ref: nn.Module, fsdp: FSDP, atol: float = 1e-5, rtol: float = 1e-5, what: str = "") -> None:
    """FSDP's full parameters have the reference's names and values (within ``atol``/``rtol``)."""
    got = full_params(fsdp)
    want = dict(ref.named_parameters())
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(got)} vs {sorted(want)}"
    for n, p in want.items():
        torch.testing.assert_close(got[n], p.detach(), atol=atol, rtol=rtol, msg=lambda m, n=n: f"{what} {n}: {m}")


def run_parity(
    rank: int,
    world_size: int,
    name: str,
    nested: bool,
    steps: int = 3,
    micro_batches: int = 1,
    use_no_sync: bool = False,
    **fsdp_kwargs: Any,
) -> list[float]:
    """Train DDP and FSDP side by side; assert the losses and the full parameters match. Returns FSDP losses."""
    ref = build_reference(name, rank)
    ddp = ddp_reference(name, ref)
    fsdp = build_fsdp(name, rank, world_size, nested, **fsdp_kwargs)
    opt_ref = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    opt = torch.optim.SGD(fsdp.parameters(), lr=LR, momentum=0.9)
    what = f"{name} nested={nested} {fsdp_kwargs} ws={world_size} rank={rank}"
    losses = []
    for i in range(steps):
        ref_loss = step(name, ddp, opt_ref, rank, i, micro_batches, ddp.no_sync if use_no_sync else None)
        loss = step(name, fsdp, opt, rank, i, micro_batches, fsdp.no_sync if use_no_sync else None)
        assert abs(ref_loss - loss) <= 1e-5 * max(1.0, abs(ref_loss)), f"{what} step {i}: {loss} vs {ref_loss}"
        losses.append(loss)
        for unit in fsdp.modules():
            if isinstance(unit, FSDP):
                assert unit.unsharded_bytes() == 0, f"{what}: unit still holds full parameters after the step"
    assert_same_params(ref, fsdp, what=what)
    for (n, b), (n2, b2) in zip(sorted(ref.named_buffers()), sorted(fsdp.named_buffers())):
        assert n == n2
        torch.testing.assert_close(b2, b, atol=1e-5, rtol=1e-5)
    return losses


def train_side_by_side(
    rank: int,
    factory: Callable[[Callable[[nn.Module], nn.Module]], nn.Module],
    loss_fn: Callable[[nn.Module, int], torch.Tensor],
    steps: int = 3,
    momentum: float = 0.9,
    **fsdp_kwargs: Any,
) -> tuple[nn.Module, FSDP]:
    """Train ``factory(identity)`` with hand-averaged gradients and ``FSDP(factory(wrap))`` side by side.

    ``factory(wrap)`` must build the same model every call, applying ``wrap`` to the pieces to nest;
    ``loss_fn(model, step)`` runs forward (and anything unusual: two passes, a shared module...) and returns
    the loss. Asserts the losses agree at every step; returns both models for further checks.
    """
    torch.manual_seed(0)
    ref = factory(lambda m: m)
    torch.manual_seed(0)
    fsdp = FSDP(factory(lambda m: FSDP(m, **fsdp_kwargs)), **fsdp_kwargs)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR, momentum=momentum)
    opt = torch.optim.SGD(fsdp.parameters(), lr=LR, momentum=momentum)
    for i in range(steps):
        torch.manual_seed(100 * i + rank)
        opt_ref.zero_grad()
        ref_loss = loss_fn(ref, i)
        ref_loss.backward()
        average_grads(ref)
        opt_ref.step()
        torch.manual_seed(100 * i + rank)
        opt.zero_grad()
        loss = loss_fn(fsdp, i)
        loss.backward()
        opt.step()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    return ref, fsdp
