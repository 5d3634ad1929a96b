"""shardkit's FSDP surface accepts fairscale 0.4.13's arguments, positionally and by keyword, with its defaults.

The expected signatures are written here as data, from fairscale 0.4.13's documented API; fairscale itself is
not imported. ``REQUIRED`` marks a parameter without a default; ``"*args"`` / ``"**kwargs"`` mark fairscale's
catch-all parameters.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest
import torch

import shardkit.nn.data_parallel as dp
import shardkit.nn.data_parallel.fsdp_optim_utils as optim_utils
import shardkit.nn.data_parallel.fully_sharded_data_parallel as fsdp_module
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP

REQUIRED = object()

#: FullyShardedDataParallel.__init__ in fairscale 0.4.13 (after ``self``), in order.
FSDP_INIT: list[tuple[str, Any]] = [
    ("module", REQUIRED),
    ("process_group", None),
    ("process_group_reduce_scatter", "reduce_scatter"),  # ProcessGroupName.reduce_scatter, a str enum
    ("reshard_after_forward", True),
    ("disable_reshard_on_root", True),
    ("mixed_precision", False),
    ("fp32_reduce_scatter", False),
    ("flatten_parameters", True),
    ("move_params_to_cpu", False),
    ("compute_dtype", None),
    ("buffer_dtype", None),
    ("move_grads_to_cpu", None),
    ("bucket_cap_mb", 25),
    ("compute_device", None),
    ("no_broadcast_optim_state", False),
    ("state_dict_device", None),
    ("clear_autocast_cache", False),
    ("force_input_to_fp32", False),
    ("verbose", False),
    ("cpu_offload", False),
    ("state_dict_on_rank_0_only", False),
    ("gradient_predivide_factor", None),
    ("allow_reset_parameters", False),
]

#: Methods of FullyShardedDataParallel (after ``self``).
FSDP_METHODS: dict[str, list[tuple[str, Any]]] = {
    "state_dict": [("*args", None), ("**kwargs", None)],
    "load_state_dict": [("state_dict", REQUIRED), ("strict", True)],
    "local_state_dict": [("*args", None), ("**kwargs", None)],
    "load_local_state_dict": [("state_dict", REQUIRED), ("strict", True)],
    "gather_full_optim_state_dict": [("optim", REQUIRED), ("**ignored", None)],
    "get_shard_from_optim_state_dict": [("full_optim_state_dict", REQUIRED)],
    "summon_full_params": [("recurse", True), ("volatile", False)],
    "clip_grad_norm_": [("max_norm", REQUIRED), ("norm_type", 2.0)],
    "no_sync": [],
    "apply": [("fn", REQUIRED)],
    "local_metadata_dict": [],
    "set_gradient_divide_factors": [("pre", REQUIRED), ("post", REQUIRED), ("recursive", REQUIRED)],
    "reset_parameters": [],
    "assert_state": [("state", REQUIRED)],
    "non_shared_params": [],
    "append_shared_param": [("p", REQUIRED)],
}

#: Static method and module-level functions.
FUNCTIONS: dict[str, tuple[Callable[..., Any], list[tuple[str, Any]]]] = {
    "consolidate_shard_weights": (
        FSDP.consolidate_shard_weights,
        [("shard_weights", REQUIRED), ("shard_metadata", REQUIRED), ("with_module_buffers", True), ("strict", True)],
    ),
    "auto_wrap_bn": (
        dp.auto_wrap_bn,
        [
            ("module", REQUIRED),
            ("single_rank_pg", False),
            ("process_group", None),
            ("fsdp_config", None),
            ("wrap_it", True),
            ("assert_on_collision", True),
        ],
    ),
    "get_fsdp_instances": (dp.get_fsdp_instances, [("mod", REQUIRED), ("skip_empty", False)]),
    "no_pre_load_state_dict_hook": (dp.no_pre_load_state_dict_hook, []),
    "is_singleton_tensor": (optim_utils.is_singleton_tensor, [("x", REQUIRED)]),
    "flatten_optim_state_dict": (optim_utils.flatten_optim_state_dict, [("sd", REQUIRED)]),
    "check_param_counts_before_sharding": (
        optim_utils.check_param_counts_before_sharding,
        [("full_optim_state_dict", REQUIRED), ("n_instances", REQUIRED)],
    ),
    "build_unflat_state_dict": (
        optim_utils.build_unflat_state_dict,
        [
            ("instance_list", REQUIRED),
            ("world_pad_info", REQUIRED),
            ("state", REQUIRED),
            ("singleton_state", REQUIRED),
            ("uncollected_opt_state", REQUIRED),
            ("original_sd", REQUIRED),
        ],
    ),
}

#: Names fairscale code imports from fairscale.nn.data_parallel.fully_sharded_data_parallel.
MODULE_EXPORTS = [
    "FullyShardedDataParallel",
    "TrainingState",
    "auto_wrap_bn",
    "get_fsdp_instances",
    "no_pre_load_state_dict_hook",
    "ProcessGroupName",
]

#: Attributes fairscale's FullyShardedDataParallel exposes (settings read back by user code).
FSDP_ATTRIBUTES = [
    "process_group",
    "process_group_reduce_scatter",
    "rank",
    "world_size",
    "reshard_after_forward",
    "disable_reshard_on_root",
    "mixed_precision",
    "fp32_reduce_scatter",
    "flatten_parameters",
    "move_params_to_cpu",
    "compute_dtype",
    "buffer_dtype",
    "move_grads_to_cpu",
    "bucket_cap_mb",
    "compute_device",
    "no_broadcast_optim_state",
    "state_dict_device",
    "clear_autocast_cache",
    "force_input_to_fp32",
    "verbose",
    "state_dict_on_rank_0_only",
    "gradient_predivide_factor",
    "gradient_postdivide_factor",
    "allow_reset_parameters",
    "cpu_offload",
    "training_state",
    "params_with_grad",
    "module",
]


def _check(fn: Callable[..., Any], expected: list[tuple[str, Any]], what: str, skip_self: bool = True) -> None:
    """Every fairscale parameter is accepted at its position and by name, with fairscale's default."""
    params = list(inspect.signature(fn).parameters.values())
    if skip_self and params and params[0].name == "self":
        params = params[1:]
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    ordered = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, (name, default) in enumerate(expected):
        if name.startswith("**"):
            assert var_kw, f"{what}: fairscale takes {name}, ours takes no **kwargs"
            continue
        if name.startswith("*"):
            assert var_pos, f"{what}: fairscale takes {name}, ours takes no *args"
            continue
        if i < len(ordered):
            ours = ordered[i]
            assert ours.name == name, f"{what}: position {i} is '{ours.name}', fairscale's is '{name}'"
        else:
            # Only a catch-all may absorb a fairscale parameter ours does not name.
            assert var_pos and var_kw, f"{what}: fairscale's '{name}' (position {i}) is not accepted"
            continue
        if default is REQUIRED:
            assert ours.default is inspect.Parameter.empty, f"{what}: '{name}' must be required, as in fairscale"
        else:
            assert ours.default == default, f"{what}: '{name}' defaults to {ours.default!r}, fairscale's to {default!r}"
    extra = ordered[len([e for e in expected if not e[0].startswith("*")]) :]
    required_extra = [p.name for p in extra if p.default is inspect.Parameter.empty]
    assert not required_extra, f"{what}: parameters fairscale does not have must have defaults: {required_extra}"


def test_constructor_matches_fairscale_positionally_and_by_keyword() -> None:
    _check(FSDP.__init__, FSDP_INIT, "FullyShardedDataParallel.__init__")
    params = list(inspect.signature(FSDP.__init__).parameters.values())[1:]
    # shardkit's own arguments come after fairscale's, keyword-only, so no fairscale positional call shifts.
    ours_only = params[len(FSDP_INIT) :]
    assert [p.name for p in ours_only] == ["backward_prefetch", "forward_prefetch", "sharding_strategy"]
    assert all(p.kind is p.KEYWORD_ONLY for p in ours_only)


@pytest.mark.parametrize("name", sorted(FSDP_METHODS))
def test_methods_accept_fairscale_arguments(name: str) -> None:
    _check(getattr(FSDP, name), FSDP_METHODS[name], f"FullyShardedDataParallel.{name}")


def test_consolidate_shard_weights_is_static() -> None:
    assert isinstance(inspect.getattr_static(FSDP, "consolidate_shard_weights"), staticmethod)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_functions_accept_fairscale_arguments(name: str) -> None:
    fn, expected = FUNCTIONS[name]
    _check(fn, expected, name, skip_self=False)


def test_module_paths_export_fairscale_names() -> None:
    missing = [n for n in MODULE_EXPORTS if not hasattr(fsdp_module, n)]
    assert not missing, f"shardkit.nn.data_parallel.fully_sharded_data_parallel lacks {missing}"
    for name in ["FullyShardedDataParallel", "TrainingState", "auto_wrap_bn", "get_fsdp_instances"]:
        assert getattr(dp, name) is getattr(fsdp_module, name)
    assert fsdp_module.ProcessGroupName.reduce_scatter == "reduce_scatter"
    assert fsdp_module.ProcessGroupName.default == "default"


def test_fairscale_attributes_exist_on_an_instance() -> None:
    from shardkit.distributed import DummyProcessGroup

    model = FSDP(torch.nn.Linear(3, 3), process_group=DummyProcessGroup(rank=0, size=1))
    missing = [n for n in FSDP_ATTRIBUTES if not hasattr(model, n)]
    assert not missing, f"FullyShardedDataParallel lacks fairscale's attributes {missing}"


def test_fsdp_optim_utils_replacements_name_what_to_call() -> None:
    assert optim_utils.is_singleton_tensor(torch.tensor(1.0))
    assert not optim_utils.is_singleton_tensor(torch.ones(1))
    with pytest.raises(NotImplementedError, match="gather_full_optim_state_dict"):
        optim_utils.build_unflat_state_dict([], [], {}, {}, {}, {})
    with pytest.raises(NotImplementedError, match="get_shard_from_optim_state_dict"):
        optim_utils.flatten_optim_state_dict({})
