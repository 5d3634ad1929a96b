"""The smp names the seed documents exist, with its argument names, order and defaults.

Expected signatures are written out here as data (from the smp PyTorch API page and, for the Apex
replacements it names, Apex's documented constructors), so this runs without SageMaker or Apex.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import pytest

import shardkit.modelparallel as smp

_NO_DEFAULT = inspect.Parameter.empty

# (object, [(name, default)]) with _NO_DEFAULT for required arguments; "self" is left out.
EXPECTED: dict[str, tuple[Callable[..., Any], list[tuple[str, Any]]]] = {
    "smp.nn.FusedLayerNorm": (
        smp.nn.FusedLayerNorm.__init__,
        [("normalized_shape", _NO_DEFAULT), ("eps", 1e-5), ("elementwise_affine", True)],
    ),
    "smp.optimizers.FusedNovoGrad": (
        smp.optimizers.FusedNovoGrad.__init__,
        [
            ("params", _NO_DEFAULT),
            ("lr", 1e-3),
            ("bias_correction", True),
            ("betas", (0.9, 0.999)),
            ("eps", 1e-8),
            ("weight_decay", 0.0),
            ("amsgrad", False),
            ("reg_inside_moment", False),
            ("grad_averaging", True),
            ("norm_type", 2),
            ("init_zero", False),
            ("set_grad_none", True),
        ],
    ),
    "smp.optimizers.FusedLamb": (
        smp.optimizers.FusedLamb.__init__,
        [
            ("params", _NO_DEFAULT),
            ("lr", 1e-3),
            ("bias_correction", True),
            ("betas", (0.9, 0.999)),
            ("eps", 1e-6),
            ("weight_decay", 0.01),
            ("amsgrad", False),
            ("adam_w_mode", True),
            ("grad_averaging", True),
            ("set_grad_none", True),
            ("max_grad_norm", 1.0),
            ("use_nvlamb", False),
        ],
    ),
    "smp.DistributedModel": (
        smp.DistributedModel.__init__,
        [
            ("module", _NO_DEFAULT),
            ("trace_device", "gpu"),
            ("trace_execution_times", False),
            ("overlapping_allreduce", True),
            ("backward_passes_per_step", 1),
            ("average_grads_across_microbatches", True),
            ("bucket_cap_mb", 25),
            ("trace_memory_usage", False),
            ("broadcast_buffers", True),
            ("gradient_as_bucket_view", False),
        ],
    ),
    "smp.DistributedModel.backward": (
        smp.DistributedModel.backward,
        [("tensors", _NO_DEFAULT), ("grad_tensors", None)],
    ),
    "smp.DistributedOptimizer": (
        smp.DistributedOptimizer.__init__,
        [("optimizer", _NO_DEFAULT), ("static_loss_scale", 1.0), ("dynamic_loss_scale", False)],
    ),
    "smp.partition": (smp.partition, [("index", _NO_DEFAULT)]),
    "smp.save": (
        smp.save,
        [("obj", _NO_DEFAULT), ("f", _NO_DEFAULT), ("partial", True), ("pickle_module", None), ("pickle_protocol", 2)],
    ),
    "smp.load": (smp.load, [("f", _NO_DEFAULT), ("map_location", None), ("pickle_module", None)]),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_documented_arguments_in_order_with_defaults(name: str) -> None:
    target, expected = EXPECTED[name]
    params = [p for p in inspect.signature(target).parameters.values() if p.name != "self"]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    got = [(p.name, p.default) for p in positional[: len(expected)]]
    assert got == expected, f"{name}: expected {expected}, got {got}"


def test_load_takes_partial_and_pickle_load_args_by_keyword() -> None:
    params = inspect.signature(smp.load).parameters
    assert params["partial"].default is True
    assert any(p.kind is p.VAR_KEYWORD for p in params.values())  # pickle_load_args


@pytest.mark.parametrize(
    "name",
    [
        "DistributedModel",
        "DistributedOptimizer",
        "step",
        "init",
        "partition",
        "save",
        "load",
        "rank",
        "size",
        "local_rank",
        "mp_rank",
        "mp_size",
        "dp_rank",
        "dp_size",
        "pp_rank",
        "pp_size",
        "barrier",
        "is_initialized",
        "get_world_process_group",
        "get_mp_process_group",
        "get_dp_process_group",
    ],
)
def test_seed_function_names_exist(name: str) -> None:
    assert callable(getattr(smp, name))


def test_seed_modules_and_classes_exist() -> None:
    import torch

    assert issubclass(smp.nn.FusedLayerNorm, torch.nn.Module)
    assert issubclass(smp.optimizers.FusedNovoGrad, torch.optim.Optimizer)
    assert issubclass(smp.optimizers.FusedLamb, torch.optim.Optimizer)
    assert smp.optimizers.FusedLAMB is smp.optimizers.FusedLamb  # Apex's spelling
    assert issubclass(smp.amp.GradScaler, torch.amp.GradScaler)
    assert isinstance(smp.DistributedModel.partitioned, property)
    for method in (
        "local_buffers",
        "local_named_buffers",
        "local_parameters",
        "local_named_parameters",
        "local_modules",
        "local_named_modules",
        "local_state_dict",
        "state_dict",
        "load_state_dict",
        "register_post_partition_hook",
        "cpu",
        "join",
    ):
        assert callable(getattr(smp.DistributedModel, method)), method
    for method in ("state_dict", "load_state_dict", "local_state_dict"):
        assert callable(getattr(smp.DistributedOptimizer, method)), method
