"""Each FSDP setting is named twice: in the constructor's signature and in its policy's builder.

``policies_from_args`` takes the constructor's arguments by name and refuses a name no policy reads (or a missing
one), so a flag added to the signature cannot be silently dropped; fairscale's read-only attributes read the
policies back through one table of :class:`~shardkit.nn.fsdp.unit_module.PolicySetting` lines.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from shardkit.distributed import DummyProcessGroup
from shardkit.nn.fsdp import BackwardPrefetch, ShardingStrategy
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp.policies import POLICY_ARGUMENTS, policies_from_args
from shardkit.nn.fsdp.unit_module import PolicySetting, UnitModule


def _signature_defaults() -> dict[str, Any]:
    params = list(inspect.signature(FSDP.__init__).parameters.values())
    return {p.name: p.default for p in params if p.name not in ("self", "module", "process_group")}


def test_every_constructor_setting_is_read_by_a_policy() -> None:
    assert set(_signature_defaults()) == POLICY_ARGUMENTS - {"replica_group"}


def test_a_missing_or_unread_setting_is_refused_by_name() -> None:
    settings = {**_signature_defaults(), "replica_group": None}
    assert policies_from_args(settings).sharding.flatten_parameters is True
    without = dict(settings)
    del without["flatten_parameters"]
    with pytest.raises(TypeError, match="missing settings \\['flatten_parameters'\\]"):
        policies_from_args(without)
    with pytest.raises(TypeError, match="no policy reads \\['flaten_parameters'\\]"):
        policies_from_args({**settings, "flaten_parameters": False})


def test_fairscale_attributes_read_the_arguments_back() -> None:
    given: dict[str, Any] = {
        "reshard_after_forward": False,
        "disable_reshard_on_root": False,
        "mixed_precision": True,
        "fp32_reduce_scatter": True,
        "flatten_parameters": False,
        "compute_dtype": torch.bfloat16,
        "buffer_dtype": torch.float32,
        "bucket_cap_mb": 5,
        "state_dict_device": torch.device("cpu"),
        "clear_autocast_cache": True,
        "verbose": True,
        "state_dict_on_rank_0_only": True,
        "allow_reset_parameters": True,
        "backward_prefetch": BackwardPrefetch.BACKWARD_POST,
        "forward_prefetch": True,
    }
    model = FSDP(torch.nn.Linear(3, 3), DummyProcessGroup(rank=0, size=1), **given)
    assert {name: getattr(model, name) for name in given} == given
    assert model.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP and model.replica_group is None
    assert not model.move_params_to_cpu and not model.move_grads_to_cpu and not model.cpu_offload
    assert model.force_input_to_fp32 is False  # under mixed precision inputs get the compute dtype instead
    with pytest.raises(AttributeError, match="pass verbose= to FullyShardedDataParallel"):
        model.verbose = False
    assert model.verbose is True


def test_the_table_documents_each_attribute() -> None:
    settings = {n: v for n, v in vars(UnitModule).items() if isinstance(v, PolicySetting)}
    assert len(settings) >= 20 and all(s.name == n and s.__doc__ for n, s in settings.items())
