"""DDPShardedStrategy (OSS + ShardedDataParallel) under a real Lightning Trainer on two CPU processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_testlib import Block, LitLM, reference_run, run_training

from testkit import assert_states_close

STEPS = 4
#: Adam normalises the near-zero gradients of the attention key bias, amplifying float noise to ~1e-6.
TOL = {"rtol": 1e-5, "atol": 2e-5}
CLIP = {"gradient_clip_val": 0.05}  # small enough to clip every step: only the global norm gives parity

Runs = list[dict[str, Any]]


@pytest.fixture
def ddp_run() -> Runs:
    return reference_run("ddp", STEPS, evaluate=True, **CLIP)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Runs, Path]:
    folder = tmp_path_factory.mktemp("sharded_checkpoints")
    return run_training("sharded", STEPS, evaluate=True, checkpoint_dir=str(folder), **CLIP), folder


@pytest.mark.timeout(150)
def test_fit_validate_test_match_ddp(ddp_run: Runs, sharded_run: tuple[Runs, Path]) -> None:
    sharded, _ = sharded_run
    trained, initial = ddp_run[0]["state"], ddp_run[0]["initial"]
    assert all(not torch.equal(trained[k], initial[k]) for k in ("model.embed.weight", "model.blocks.0.fc1.weight"))
    for rank in range(2):
        assert sharded[rank]["trainer_model"] == "ShardedDataParallel"
        assert_states_close(sharded[rank]["state"], ddp_run[rank]["state"], **TOL)
        assert sharded[rank]["validate"]["val_loss"] == pytest.approx(ddp_run[rank]["validate"]["val_loss"], rel=1e-5)
        assert sharded[rank]["test"]["test_loss"] == pytest.approx(ddp_run[rank]["test"]["test_loss"], rel=1e-5)
        assert_states_close(sharded[rank]["state_after_eval"], sharded[rank]["state"])


@pytest.mark.timeout(150)
def test_checkpoint_resume_continues_identically(sharded_run: tuple[Runs, Path]) -> None:
    straight, folder = sharded_run
    saved = folder / "epoch=0.ckpt"  # written by Lightning's ModelCheckpoint after step 2
    # The optimizer state is consolidated: the full model's, loadable into the plain optimizer class.
    checkpoint = torch.load(saved, weights_only=False)
    model = LitLM()
    plain = torch.optim.AdamW(model.parameters(), lr=0.02)
    plain.load_state_dict(checkpoint["optimizer_states"][0])
    assert len(checkpoint["optimizer_states"][0]["state"]) == len(list(model.parameters()))
    resumed = run_training("sharded", STEPS, resume_from=str(saved), **CLIP)
    for rank in range(2):
        assert_states_close(resumed[rank]["state"], straight[rank]["state"], rtol=0, atol=0)


@pytest.mark.timeout(150)
def test_fp16_mixed_precision_with_sharded_loss_scaling(ddp_run: Runs) -> None:
    # Lightning maps Trainer(precision="16-mixed") to bf16 on CPU; an explicit plugin keeps fp16 (and its scaler).
    from lightning.pytorch.plugins.precision import MixedPrecision

    sharded = run_training("sharded", STEPS, plugins=[MixedPrecision("16-mixed", "cpu")], **CLIP)
    for rank in range(2):
        assert sharded[rank]["scaler"] == "ShardedGradScaler"
        assert sharded[rank]["losses"] == pytest.approx(ddp_run[rank]["losses"], rel=5e-3)
        assert sharded[rank]["losses"] != ddp_run[rank]["losses"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["sharded", "fsdp"])
def test_gradient_accumulation_matches_ddp(kind: str) -> None:
    # Lightning skips the gradient sync of the first micro-batch through strategy.block_backward_sync().
    accumulate = {"accumulate_grad_batches": 2, **CLIP}
    ddp = reference_run("ddp", 2, **accumulate)
    strategy_kwargs = {"transformer_layer_cls": Block} if kind == "fsdp" else {}
    other = run_training(kind, 2, strategy_kwargs=strategy_kwargs, **accumulate)
    for rank in range(2):
        assert len(other[rank]["losses"]) == 4  # two optimizer steps of two micro-batches
        assert_states_close(other[rank]["state"], ddp[rank]["state"], **TOL)
