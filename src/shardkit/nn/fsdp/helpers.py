"""Module-level FSDP helpers fairscale code imports: :func:`auto_wrap_bn`, :func:`get_fsdp_instances` and
:func:`no_pre_load_state_dict_hook`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch.distributed as dist
from torch import nn

from shardkit.distributed.dummy import DummyProcessGroup
from shardkit.distributed.groups import GroupLike
from shardkit.nn._torch_private import BatchNormBase
from shardkit.nn.fsdp.api import FullyShardedDataParallel
from shardkit.nn.wrap import auto_wrap, config_auto_wrap_policy, enable_wrap


def get_fsdp_instances(mod: nn.Module, skip_empty: bool = False) -> list[FullyShardedDataParallel]:
    """Every :class:`FullyShardedDataParallel` in ``mod`` (``mod`` itself included), in ``mod.modules()`` order.

    With ``skip_empty``, units that own no parameters of their own are left out.
    """
    found = [m for m in mod.modules() if isinstance(m, FullyShardedDataParallel)]
    if skip_empty:
        found = [m for m in found if m.non_shared_params()]
    return found


def auto_wrap_bn(
    module: nn.Module,
    single_rank_pg: bool = False,
    process_group: Optional[GroupLike] = None,
    fsdp_config: Optional[dict[str, Any]] = None,
    wrap_it: bool = True,
    assert_on_collision: bool = True,
) -> nn.Module:
    """Put every BatchNorm of ``module`` in its own full-precision, unflattened FSDP unit (fairscale's helper).

    Batch statistics are numerically fragile in 16-bit and SyncBatchNorm keeps its own communication, so each BN
    gets a unit with ``mixed_precision=False``, ``flatten_parameters=False`` and ``reshard_after_forward=False``
    (which also keeps ``FSDP(checkpoint_wrapper(FSDP(bn)))`` correct when forward runs more than once). The
    outer units may still compute in 16-bit around them.

    Args:
        module: the model (or part of it) whose BatchNorm layers to wrap; call on every rank.
        single_rank_pg: put each BN unit in a process group of this rank alone (no sharding; every rank keeps
            its own copy). All ranks create those groups together, as ``new_group`` requires.
        process_group: the group the BN units shard over (default: the world; ignored with ``single_rank_pg``).
        fsdp_config: wrapper arguments for the BN units, replacing the defaults above.
        wrap_it: wrap now (returns the wrapped module); False only tags the BN layers with ``wrapper_config``
            for a later ``auto_wrap(..., auto_wrap_policy=config_auto_wrap_policy)`` inside ``enable_wrap``.
        assert_on_collision: raise if a BN layer already carries a ``wrapper_config`` (another policy tagged it).

    Example::

        model = auto_wrap_bn(model, single_rank_pg=False)
        model = FullyShardedDataParallel(model, mixed_precision=True)
    """
    bns = [m for m in module.modules() if isinstance(m, BatchNormBase)]
    if assert_on_collision:
        tagged = [type(m).__name__ for m in bns if hasattr(m, "wrapper_config")]
        if tagged:
            raise ValueError(
                f"auto_wrap_bn: {len(tagged)} BatchNorm layer(s) already carry a wrapper_config (tagged by another "
                "policy?); remove it, or pass assert_on_collision=False to overwrite it"
            )
    group = _single_rank_group() if single_rank_pg else process_group
    config = (
        dict(fsdp_config)
        if fsdp_config is not None
        else {
            "process_group": group,
            "mixed_precision": False,  # statistics and weights in FP32
            "flatten_parameters": False,
            "reshard_after_forward": False,
            "bucket_cap_mb": 0,
            "force_input_to_fp32": False,  # SyncBatchNorm under autocast may want True (pass fsdp_config)
        }
    )
    for bn in bns:
        # The tag config_auto_wrap_policy reads; a plain attribute, the module's behaviour is untouched.
        bn.wrapper_config = config  # type: ignore[assignment]
    scope = enable_wrap(config_auto_wrap_policy, wrapper_cls=FullyShardedDataParallel) if wrap_it else None
    with scope if scope is not None else contextlib.nullcontext():
        return auto_wrap(module)


def _single_rank_group() -> GroupLike:
    if not dist.is_available() or not dist.is_initialized():
        return DummyProcessGroup(rank=0, size=1)
    # new_group is collective over the world: every rank creates every single-rank group, then keeps its own.
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


@contextlib.contextmanager
def no_pre_load_state_dict_hook() -> Iterator[None]:
    """Accepted for fairscale code; does nothing in shardkit.

    fairscale needed it to load a state dict not produced by a root FSDP instance, because its pre-load hook
    rewrote keys into its wrapper's ``_fsdp_wrapped_module.`` naming. shardkit's state dicts always use the
    unwrapped model's names, so there is no hook to disable: such state dicts load as they are.
    """
    yield
