"""The Lightning integration without processes: registry, precision mapping, argument checks, import isolation."""

from __future__ import annotations

import functools
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import StrategyRegistry

from shardkit.lightning import DDPFullyShardedStrategy, DDPShardedStrategy, FullyShardedStrategy
from shardkit.lightning.precision import ShardedMixedPrecision, ShardedPrecision, to_sharded_precision
from shardkit.nn.wrap import default_auto_wrap_policy, transformer_auto_wrap_policy
from shardkit.optim import ShardedGradScaler
from shardkit.testing.models import Block


def test_core_package_never_imports_lightning() -> None:
    code = (
        "import sys, shardkit, shardkit.nn, shardkit.optim\n"
        "from shardkit.nn import FullyShardedDataParallel, ShardedDataParallel, checkpoint_wrapper, wrap\n"
        "from shardkit.nn.checkpoint import apply_activation_checkpointing\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _trainer(strategy: object, **kwargs: object) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, **kwargs)  # type: ignore[arg-type]


def test_registered_names_build_the_strategies() -> None:
    assert {"shardkit_fsdp", "shardkit_sharded"} <= set(StrategyRegistry.available_strategies())
    assert FullyShardedStrategy is DDPFullyShardedStrategy
    assert isinstance(_trainer("shardkit_fsdp").strategy, DDPFullyShardedStrategy)
    trainer = _trainer("shardkit_sharded", precision="bf16-mixed")
    assert isinstance(trainer.strategy, DDPShardedStrategy)
    assert isinstance(trainer.precision_plugin, ShardedMixedPrecision)
    assert trainer.precision_plugin.compute_dtype == torch.bfloat16


def test_precision_plugins_become_sharding_aware() -> None:
    assert isinstance(to_sharded_precision(Precision(), "S"), ShardedPrecision)
    fp16 = to_sharded_precision(MixedPrecision("16-mixed", "cpu"), "S")
    assert isinstance(fp16, ShardedMixedPrecision) and isinstance(fp16.scaler, ShardedGradScaler)
    assert fp16.compute_dtype == torch.float16
    bf16 = to_sharded_precision(MixedPrecision("bf16-mixed", "cpu"), "S")
    assert isinstance(bf16, ShardedMixedPrecision) and bf16.scaler is None
    # Lightning itself turns 16-mixed into bf16-mixed on CPU (with a warning); the strategy follows.
    with pytest.warns(UserWarning, match="bf16-mixed"):
        trainer = _trainer(DDPFullyShardedStrategy(), precision="16-mixed")
    assert trainer.precision_plugin.precision == "bf16-mixed"
    with pytest.raises(ValueError, match=r"supports Trainer\(precision=...\)"):
        _trainer(DDPFullyShardedStrategy(), precision="16-true")


def test_unsupported_autocast_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fp16_autocast(device_type: str, dtype: torch.dtype, **kwargs: object) -> object:
        raise RuntimeError("CPU autocast only supports bfloat16")

    monkeypatch.setattr(torch, "autocast", no_fp16_autocast)
    with pytest.raises(ValueError, match="Use precision='bf16-mixed' instead"):
        to_sharded_precision(MixedPrecision("16-mixed", "cpu"), "DDPFullyShardedStrategy")


def test_wrap_options_translate_into_one_policy() -> None:
    by_size = DDPFullyShardedStrategy(min_num_params=1000).config.auto_wrap_policy
    assert isinstance(by_size, functools.partial) and by_size.func is default_auto_wrap_policy
    assert by_size.keywords == {"min_num_params": 1000}
    for strategy in (
        DDPFullyShardedStrategy(transformer_layer_cls=Block),
        DDPFullyShardedStrategy(auto_wrap_policy={Block}),
    ):
        by_class = strategy.config.auto_wrap_policy
        assert isinstance(by_class, functools.partial) and by_class.func is transformer_auto_wrap_policy
        assert by_class.keywords == {"transformer_layer_cls": (Block,)}
    custom = DDPFullyShardedStrategy(auto_wrap_policy=default_auto_wrap_policy).config.auto_wrap_policy
    assert custom is default_auto_wrap_policy
    config = DDPFullyShardedStrategy(cpu_offload=True, reshard_after_forward=False, activation_checkpointing=[Block])
    assert config.config.fsdp_kwargs["cpu_offload"].offload_params
    assert config.config.fsdp_kwargs["reshard_after_forward"] is False
    assert config.config.checkpoint_on is not None and config.config.checkpoint_on(Block.__new__(Block))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"min_num_params": 10, "transformer_layer_cls": Block}, ValueError, "pass only one of"),
        ({"auto_wrap_policy": 3}, TypeError, "auto_wrap_policy must be"),
        ({"transformer_layer_cls": [int]}, TypeError, "nn.Module subclasses"),
        ({"activation_checkpointing": "Block"}, TypeError, "nn.Module subclasses"),
        ({"state_dict_type": "local"}, ValueError, "'full' or 'sharded'"),
        ({"cpu_offload": "yes"}, TypeError, "cpu_offload must be"),
        ({"compute_device": "cpu"}, ValueError, "set by the strategy"),
        ({"start_method": "thread"}, ValueError, "start_method must be"),
        ({"min_num_params": 0}, ValueError, "positive"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        DDPFullyShardedStrategy(**kwargs)


def test_wrap_in_configure_model_is_a_no_op_outside_the_strategy() -> None:
    from lightning_testlib import ConfiguredLitLM

    from shardkit.nn import FullyShardedDataParallel

    module = ConfiguredLitLM()
    module.configure_model()  # no strategy context: shardkit.nn.wrap.wrap returns the blocks unchanged
    assert module.model is not None
    assert not any(isinstance(m, FullyShardedDataParallel) for m in module.modules())
    assert all(type(b).__name__ == "Block" for b in module.model.blocks)
