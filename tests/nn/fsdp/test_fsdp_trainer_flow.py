"""A training framework's FSDP and OSS checkpoint paths, driven the way fairseq's trainer drives fairscale's.

The framework subclasses FSDP (its ``state_dict`` answers the local shards when checkpoints are sharded, and the
full model on rank 0 otherwise), builds the model inside ``enable_wrap`` with its own keyword set (one of which,
``use_sharded_state``, only its subclass takes), wraps blocks with ``wrap``, and steps an optimizer wrapper that is
not a torch optimizer. Two steps, a save, a fresh model and optimizer, a resume, two more steps: the parameters
equal torch DDP's after four uninterrupted steps, at world sizes 1 and 2. Sharded checkpoints also consolidate
offline (``consolidate_shard_weights``) into DDP's state at the save. The OSS path saves a consolidated optimizer
state on rank 0 and broadcasts it back on resume.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.distributed import broadcast_object
from shardkit.nn import enable_wrap, wrap
from shardkit.nn.fsdp import FullyShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import models as M
from shardkit.testing import run_distributed

GLOBAL_BATCH = 4
SAVE_AT, STEPS = 2, 4


class FrameworkFSDP(FullyShardedDataParallel):
    """A framework's subclass: one switch picks sharded (per-rank) or full (rank 0) checkpoints."""

    def __init__(self, *args: Any, use_sharded_state: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.use_sharded_state = use_sharded_state

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:  # type: ignore[override]
        if self.use_sharded_state:
            return self.local_state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        full = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return full if self.rank == 0 else {}  # every rank gathers; only rank 0 keeps the result

    def load_state_dict(self, state_dict: Any, strict: bool = True) -> Any:  # type: ignore[override]
        if self.use_sharded_state:
            return self.load_local_state_dict(state_dict, strict=strict)
        return super().load_state_dict(broadcast_object(state_dict, 0, self.process_group), strict=strict)


class FrameworkOptimizer:
    """The framework's optimizer object: it holds a torch optimizer and passes the usual calls through."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()


def _framework_config(sharded: bool) -> dict[str, Any]:
    """The keywords the framework gives ``enable_wrap`` (fp32 training, flat parameters, no offload)."""
    return {
        "wrapper_cls": FrameworkFSDP,
        "use_sharded_state": sharded,
        "process_group": dist.group.WORLD,
        "reshard_after_forward": True,
        "mixed_precision": False,
        "fp32_reduce_scatter": False,
        "flatten_parameters": True,
        "cpu_offload": False,
        "compute_dtype": torch.float32,
        "bucket_cap_mb": 25,
        "state_dict_device": torch.device("cpu"),
    }


def _build_fsdp(sharded: bool, seed: int) -> FrameworkFSDP:
    model = M.build("lm", seed=seed)
    with enable_wrap(**_framework_config(sharded)):  # the model's own code wraps its layers, then the trainer it
        for i, block in enumerate(model.blocks):
            model.blocks[i] = wrap(block)
        model = wrap(model)
    assert isinstance(model, FrameworkFSDP) and sum(isinstance(m, FrameworkFSDP) for m in model.modules()) > 1
    return model


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01, eps=1e-3)


def _steps(model: nn.Module, opt: Any, steps: range, rank: int, world_size: int) -> None:
    per_rank = GLOBAL_BATCH // world_size
    for step in steps:
        x, y = M.lm_batch(M.LMConfig(), GLOBAL_BATCH, seed=900 + step)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        M.TransformerLM.loss_fn(model(x[rows]), y[rows]).backward()
        opt.step()


def _ddp_reference(rank: int, world_size: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """DDP's parameters at the save and at the end (same seed, same batches)."""
    ddp = DDP(M.build("lm", seed=0))
    opt = _optimizer(ddp.parameters())
    _steps(ddp, opt, range(SAVE_AT), rank, world_size)
    at_save = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    _steps(ddp, opt, range(SAVE_AT, STEPS), rank, world_size)
    return at_save, {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}


def _full_params(model: FullyShardedDataParallel) -> dict[str, torch.Tensor]:
    with model.summon_full_params(volatile=True):
        return {k: v.detach().clone() for k, v in model.named_parameters()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in got if not torch.allclose(got[k], want[k], rtol=0, atol=1e-6)] or (
        [] if set(got) <= set(want) else ["keys"]
    )


def _full_checkpoints(rank: int, world_size: int) -> list[str]:
    _, want = _ddp_reference(rank, world_size)
    model = _build_fsdp(sharded=False, seed=0)
    opt = FrameworkOptimizer(_optimizer(model.parameters()))
    _steps(model, opt, range(SAVE_AT), rank, world_size)
    saved_optim = model.gather_full_optim_state_dict(opt)  # rank 0 only, like the saved file
    saved_model = model.state_dict()
    assert (saved_optim is None) == (rank != 0) and bool(saved_model) == (rank == 0)
    # Resume into a new model and optimizer (another seed: everything must come from the checkpoint).
    model = _build_fsdp(sharded=False, seed=7)
    opt = FrameworkOptimizer(_optimizer(model.parameters()))
    model.load_state_dict(saved_model)
    full_optim = broadcast_object(saved_optim, 0)  # every rank reads the checkpoint file
    opt.load_state_dict(model.get_shard_from_optim_state_dict(full_optim))
    _steps(model, opt, range(SAVE_AT, STEPS), rank, world_size)
    return _same(_full_params(model), want)


def _sharded_checkpoints(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    at_save, want = _ddp_reference(rank, world_size)
    model = _build_fsdp(sharded=True, seed=0)
    opt = FrameworkOptimizer(_optimizer(model.parameters()))
    _steps(model, opt, range(SAVE_AT), rank, world_size)
    shard = {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(opt.state_dict())}
    shard["meta"] = model.local_metadata_dict()
    everyone: list[Optional[dict[str, Any]]] = [None] * world_size
    dist.all_gather_object(everyone, shard)
    consolidated = FrameworkFSDP.consolidate_shard_weights(
        [s["model"] for s in everyone if s], [s["meta"] for s in everyone if s]
    )
    model = _build_fsdp(sharded=True, seed=7)
    opt = FrameworkOptimizer(_optimizer(model.parameters()))
    model.load_state_dict(shard["model"])
    opt.load_state_dict(shard["optim"])
    _steps(model, opt, range(SAVE_AT, STEPS), rank, world_size)
    return _same(consolidated, at_save), _same(_full_params(model), want)


class FrameworkOSS(OSS):
    """The framework's OSS subclass: the consolidated state saved by rank 0 is broadcast back on resume."""

    def broadcast_global_state_dict(self, state_dict: Optional[dict[str, Any]]) -> dict[str, Any]:
        return broadcast_object(state_dict, 0, self.group)


def _oss_checkpoints(rank: int, world_size: int) -> list[str]:
    _, want = _ddp_reference(rank, world_size)

    def build(seed: int) -> tuple[DDP, FrameworkOSS]:
        ddp = DDP(M.build("lm", seed=seed))
        plain = _optimizer(ddp.parameters())  # the framework builds a torch optimizer, then shards it
        return ddp, FrameworkOSS(plain.param_groups, type(plain), group=dist.group.WORLD, lr=0.01, eps=1e-3)

    ddp, oss = build(0)
    _steps(ddp, oss, range(SAVE_AT), rank, world_size)
    oss.consolidate_state_dict(recipient_rank=0)
    saved_optim = oss.state_dict() if rank == 0 else None
    saved_model = ddp.module.state_dict()
    ddp, oss = build(7)
    ddp.module.load_state_dict(saved_model)
    oss.load_state_dict(oss.broadcast_global_state_dict(saved_optim))
    _steps(ddp, oss, range(SAVE_AT, STEPS), rank, world_size)
    return _same(dict(ddp.module.named_parameters()), want)


def test_full_checkpoints_resume_like_ddp() -> None:
    for world_size in (1, 2):
        assert run_distributed(_full_checkpoints, world_size, timeout_s=180) == [[]] * world_size


def test_sharded_checkpoints_resume_and_consolidate_like_ddp() -> None:
    for world_size in (1, 2):
        assert run_distributed(_sharded_checkpoints, world_size, timeout_s=180) == [([], [])] * world_size


def test_oss_checkpoints_resume_like_ddp() -> None:
    for world_size in (1, 2):
        assert run_distributed(_oss_checkpoints, world_size, timeout_s=180) == [[]] * world_size
