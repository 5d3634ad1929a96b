"""DDPFullyShardedStrategy under a real Lightning Trainer on two CPU processes: parity with DDP, auto-wrap and
manual wrap, activation checkpointing, checkpoints (full and sharded) that resume identically, bf16, spawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_testlib import Block, LitLM, reference_run, run_training, trainer_for

from shardkit.testing import DistributedTestError
from testkit import assert_states_close

STEPS = 4
TOL = {"rtol": 1e-5, "atol": 2e-5}  # Adam amplifies float noise in the near-zero key-bias gradients
CLIP = {"gradient_clip_val": 0.05}  # clips every step: the root's global norm is needed for parity
BLOCKS = {"transformer_layer_cls": Block}
CHECKPOINTED_SHARDED = {**BLOCKS, "activation_checkpointing": Block, "state_dict_type": "sharded"}

Runs = list[dict[str, Any]]


@pytest.fixture
def ddp_run() -> Runs:
    return reference_run("ddp", STEPS, evaluate=True, **CLIP)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Runs, Path]:
    """Blocks auto-wrapped, full checkpoints after every epoch (2 steps)."""
    folder = tmp_path_factory.mktemp("fsdp_full")
    return run_training(
        "fsdp", STEPS, strategy_kwargs=BLOCKS, evaluate=True, checkpoint_dir=str(folder), **CLIP
    ), folder


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Runs, Path]:
    """Blocks auto-wrapped and activation-checkpointed, sharded checkpoints after every epoch."""
    folder = tmp_path_factory.mktemp("fsdp_sharded")
    return run_training("fsdp", STEPS, strategy_kwargs=CHECKPOINTED_SHARDED, checkpoint_dir=str(folder), **CLIP), folder


@pytest.mark.timeout(150)
def test_fit_validate_test_match_ddp(ddp_run: Runs, fsdp_run: tuple[Runs, Path]) -> None:
    fsdp, _ = fsdp_run
    for rank in range(2):
        assert fsdp[rank]["trainer_model"] == "CheckpointedShardUnit"
        assert fsdp[rank]["units"] == 3  # two blocks and the root
        assert_states_close(fsdp[rank]["state"], ddp_run[rank]["state"], **TOL)
        assert fsdp[rank]["validate"]["val_loss"] == pytest.approx(ddp_run[rank]["validate"]["val_loss"], rel=1e-5)
        assert fsdp[rank]["test"]["test_loss"] == pytest.approx(ddp_run[rank]["test"]["test_loss"], rel=1e-5)
        assert_states_close(fsdp[rank]["state_after_eval"], fsdp[rank]["state"])


@pytest.mark.timeout(150)
def test_full_checkpoint_resumes_identically(fsdp_run: tuple[Runs, Path]) -> None:
    fsdp, folder = fsdp_run
    saved = folder / "epoch=0.ckpt"
    # The LightningModule's own keys and the whole model's optimizer state, loadable without shardkit.
    checkpoint = torch.load(saved, weights_only=False)
    assert checkpoint["state_dict"].keys() == fsdp[0]["state"].keys()
    model = LitLM()
    torch.optim.AdamW(model.parameters()).load_state_dict(checkpoint["optimizer_states"][0])
    model.load_state_dict(checkpoint["state_dict"])
    resumed = run_training("fsdp", STEPS, strategy_kwargs=BLOCKS, resume_from=str(saved), **CLIP)
    for rank in range(2):
        assert_states_close(resumed[rank]["state"], fsdp[rank]["state"], rtol=0, atol=0)


@pytest.mark.timeout(150)
def test_activation_checkpointing_saves_memory_and_keeps_gradients(
    fsdp_run: tuple[Runs, Path], checkpointed_run: tuple[Runs, Path]
) -> None:
    (plain, _), (ckpt, _) = fsdp_run, checkpointed_run
    for rank in range(2):
        assert ckpt[rank]["checkpointed"] == 2
        # The forward keeps only each block's input instead of everything the block computes.
        assert max(ckpt[rank]["saved_bytes"]) < 0.6 * min(plain[rank]["saved_bytes"])
        assert ckpt[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-6)
        assert_states_close(ckpt[rank]["state"], plain[rank]["state"], rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(150)
def test_sharded_checkpoint_resumes_identically(checkpointed_run: tuple[Runs, Path]) -> None:
    straight, folder = checkpointed_run
    saved = folder / "epoch=0.ckpt"
    assert saved.is_dir() and (saved / "meta.pt").is_file()
    assert len(list(saved.glob("*.distcp"))) == 2  # each rank wrote its own shard
    resumed = run_training("fsdp", STEPS, strategy_kwargs=CHECKPOINTED_SHARDED, resume_from=str(saved), **CLIP)
    for rank in range(2):
        assert_states_close(resumed[rank]["state"], straight[rank]["state"], rtol=0, atol=0)


@pytest.mark.timeout(150)
def test_manual_wrap_in_configure_model_by_registry_name(ddp_run: Runs) -> None:
    # The blocks are wrapped with shardkit.nn.wrap.wrap inside configure_model; the strategy comes by name.
    fsdp = run_training("shardkit_fsdp", STEPS, build_in="configure_model", **CLIP)
    for rank in range(2):
        assert fsdp[rank]["trainer_model"] == "CheckpointedShardUnit" and fsdp[rank]["units"] == 3
        assert_states_close(fsdp[rank]["state"], ddp_run[rank]["state"], **TOL)


@pytest.mark.timeout(150)
def test_manual_wrap_in_the_legacy_configure_sharded_model_hook(ddp_run: Runs) -> None:
    fsdp = run_training("fsdp", STEPS, build_in="configure_sharded_model", **CLIP)
    for rank in range(2):
        assert fsdp[rank]["units"] == 3
        assert_states_close(fsdp[rank]["state"], ddp_run[rank]["state"], **TOL)


@pytest.mark.timeout(150)
def test_optimizer_over_self_parameters_is_a_clear_error() -> None:
    with pytest.raises(DistributedTestError, match=r"self\.trainer\.model\.parameters\(\)"):
        run_training("fsdp", STEPS, strategy_kwargs=BLOCKS, build_in="init_self_parameters")


@pytest.mark.timeout(150)
def test_bf16_mixed_precision_computes_in_bfloat16(ddp_run: Runs) -> None:
    fsdp = run_training("fsdp", STEPS, strategy_kwargs=BLOCKS, precision="bf16-mixed", **CLIP)
    for rank in range(2):
        assert fsdp[rank]["compute_dtype"] == "torch.bfloat16"
        assert all(v.dtype == torch.float32 for v in fsdp[rank]["state"].values())  # fp32 master weights
        # bf16 rounding moves the loss by ~1e-3; AdamW turns such differences into sign flips of near-zero
        # updates, so the weights are compared through the loss, against the fp32 DDP run.
        assert fsdp[rank]["losses"] == pytest.approx(ddp_run[rank]["losses"], rel=5e-3)
        assert fsdp[rank]["losses"] != ddp_run[rank]["losses"]


@pytest.mark.timeout(150)
def test_lightning_starts_the_processes_and_returns_full_weights(ddp_run: Runs) -> None:
    from lightning.pytorch import seed_everything

    from shardkit.lightning import FullyShardedStrategy

    seed_everything(7, verbose=False)
    model = LitLM()
    # Lightning's multiprocessing launcher (forkserver: the workers fork from a server that already imported
    # torch; "spawn" and "fork" go through the same launcher).
    trainer = trainer_for(FullyShardedStrategy(start_method="forkserver", **BLOCKS), STEPS, **CLIP)
    trainer.fit(model)
    # Under full sharding the workers' LightningModule holds flat shards; the strategy's launcher sends the
    # gathered state dict back instead, so this process's module has the trained weights.
    state = {k: v.float() for k, v in model.state_dict().items()}
    assert_states_close(state, ddp_run[0]["state"], **TOL)


@pytest.mark.timeout(150)
def test_fp16_mixed_precision_with_sharded_loss_scaling(ddp_run: Runs) -> None:
    # Lightning maps Trainer(precision="16-mixed") to bf16 on CPU; an explicit plugin keeps fp16 (and its scaler).
    from lightning.pytorch.plugins.precision import MixedPrecision

    offloaded = {**BLOCKS, "cpu_offload": True}  # shards already live on the CPU here: exercises the argument
    fsdp = run_training("fsdp", STEPS, strategy_kwargs=offloaded, plugins=[MixedPrecision("16-mixed", "cpu")], **CLIP)
    for rank in range(2):
        assert fsdp[rank]["compute_dtype"] == "torch.float16"
        assert fsdp[rank]["scaler"] == "ShardedGradScaler"  # skip decisions agreed across ranks
        assert fsdp[rank]["losses"] == pytest.approx(ddp_run[rank]["losses"], rel=5e-3)
