"""Shared pieces of the Lightning strategy tests: a tiny LightningModule, its data, and one training run.

Runs are launched with :func:`shardkit.testing.run_distributed` (the processes exist before Lightning starts,
as under torchrun), so several Trainers can run in the same two processes and a hang fails the test instead
of the suite. One test also lets Lightning spawn the processes itself.
"""

from __future__ import annotations

import io
import warnings
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from shardkit.testing import run_distributed
from shardkit.testing.models import Block, LMConfig, TransformerLM

CFG = LMConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=2, seq_len=8, dropout=0.1)
BATCH = 2
#: 8 samples over 2 ranks in batches of 2: an epoch is 2 optimizer steps.
SAMPLES = 8

warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|litlogger|GPU available).*")


def token_data(seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, CFG.vocab_size, (SAMPLES, CFG.seq_len + 1), generator=gen)
    return TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())


class LitLM(pl.LightningModule):
    """A two-block GPT (dropout on, tied embedding) trained with AdamW and a step LR schedule.

    Built in ``__init__``; the subclasses build it in a hook instead (see :meth:`build_and_wrap`).
    """

    builds_in_hook = False

    def __init__(self, lr: float = 0.02) -> None:
        super().__init__()
        self.lr = lr
        self.model: Optional[nn.Module] = None if self.builds_in_hook else TransformerLM(CFG)
        self.saved_bytes: list[int] = []
        self.losses: list[float] = []
        self.wrapper_seen = ""
        self.units_seen = 0
        self.compute_dtype_seen = ""
        self.checkpointed_seen = 0

    def on_train_start(self) -> None:
        wrapper = self.trainer.model
        self.wrapper_seen = type(wrapper).__name__
        units = [m for m in wrapper.modules() if type(m).__name__.endswith(("FullyShardedDataParallel", "ShardUnit"))]
        self.units_seen = len(units)
        self.compute_dtype_seen = str(getattr(wrapper, "compute_dtype", None))
        self.checkpointed_seen = sum(type(m).__name__ == "CheckpointWrapper" for m in wrapper.modules())

    def build_and_wrap(self) -> None:
        """Create the network and wrap each block with ``shardkit.nn.wrap.wrap`` (the manual-wrapping path;
        a no-op outside the fully sharded strategy)."""
        if self.model is not None:
            return
        from shardkit.nn.wrap import wrap

        torch.manual_seed(7)  # as pl.seed_everything(7) left it: the same weights as building in __init__
        model = TransformerLM(CFG)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = wrap(block)
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model(tokens)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        # Dropout masks depend only on the step, so a resumed run draws what the uninterrupted one drew.
        torch.manual_seed(1000 + self.global_step)
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = TransformerLM.loss_fn(self(tokens), targets)
        self.saved_bytes.append(total)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, targets = batch
        self.log("val_loss", TransformerLM.loss_fn(self(tokens), targets), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        tokens, targets = batch
        self.log("test_loss", TransformerLM.loss_fn(self(tokens), targets), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.trainer.model.parameters(), lr=self.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _loader(self, seed: int) -> DataLoader:
        # A fixed, unshuffled split per rank (Trainer(use_distributed_sampler=False)): every run and every resumed
        # run sees the same batches at the same step.
        data = token_data(seed)
        sampler = DistributedSampler(data, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader(0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(1)

    def test_dataloader(self) -> DataLoader:
        return self._loader(2)


class ConfiguredLitLM(LitLM):
    """Builds and wraps in ``configure_model``."""

    builds_in_hook = True

    def configure_model(self) -> None:
        self.build_and_wrap()


class LegacyLitLM(LitLM):
    """Builds and wraps in the older ``configure_sharded_model`` hook."""

    builds_in_hook = True

    def configure_sharded_model(self) -> None:
        self.build_and_wrap()


class SelfParametersLitLM(LitLM):
    """The mistake the fully sharded strategy must catch: an optimizer over ``self.parameters()``."""

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


MODULES = {
    "init": LitLM,
    "configure_model": ConfiguredLitLM,
    "configure_sharded_model": LegacyLitLM,
    "init_self_parameters": SelfParametersLitLM,
}


def make_strategy(kind: str, **kwargs: Any) -> Any:
    if kind == "ddp":
        return DDPStrategy(**kwargs)
    from shardkit.lightning import DDPFullyShardedStrategy, DDPShardedStrategy

    if kind == "sharded":
        return DDPShardedStrategy(**kwargs)
    if kind == "fsdp":
        return DDPFullyShardedStrategy(**kwargs)
    return kind  # a registry name


def trainer_for(strategy: Any, steps: int, **kwargs: Any) -> pl.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": strategy,
        "max_steps": steps,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 2,
        "limit_test_batches": 2,
        "use_distributed_sampler": False,
    }
    settings.update(kwargs)
    return pl.Trainer(**settings)


def final_state(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """The full model state after training (a collective under sharding), as CPU float tensors."""
    strategy = trainer.strategy
    state = (
        strategy.full_state_dict() if hasattr(strategy, "full_state_dict") else strategy.lightning_module_state_dict()
    )
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}


def train(
    rank: int,
    world_size: int,
    kind: str,
    steps: int,
    strategy_kwargs: Optional[dict[str, Any]] = None,
    build_in: str = "init",
    checkpoint_dir: Optional[str] = None,
    resume_from: Optional[str] = None,
    evaluate: bool = False,
    **trainer_kwargs: Any,
) -> bytes:
    """Seeded fit (optionally resumed, optionally followed by validate and test); what every rank saw."""
    pl.seed_everything(7, verbose=False)
    model = MODULES[build_in]()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if checkpoint_dir is not None:
        # Lightning's own checkpointing: one checkpoint at the end of every epoch (every 2 steps).
        checkpointing = ModelCheckpoint(dirpath=checkpoint_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
        trainer_kwargs.update(callbacks=[checkpointing], enable_checkpointing=True)
    trainer = trainer_for(make_strategy(kind, **(strategy_kwargs or {})), steps, **trainer_kwargs)
    trainer.fit(model, ckpt_path=resume_from)
    result: dict[str, Any] = {"state": final_state(trainer), "saved_bytes": model.saved_bytes, "initial": initial}
    result["losses"] = model.losses
    result["trainer_model"] = model.wrapper_seen
    result["units"], result["compute_dtype"] = model.units_seen, model.compute_dtype_seen
    result["checkpointed"] = model.checkpointed_seen
    result["scaler"] = type(getattr(trainer.precision_plugin, "scaler", None)).__name__
    if evaluate:
        result["validate"] = trainer.validate(model, verbose=False)[0]
        result["test"] = trainer.test(model, verbose=False)[0]
        result["state_after_eval"] = final_state(trainer)
    # Tensors travel back as bytes: torch's shared-memory pickling would not outlive the worker process.
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def run_training(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """:func:`train` on two processes; every rank's result."""
    return [torch.load(io.BytesIO(raw), weights_only=False) for raw in run_distributed(train, 2, *args, **kwargs)]


_REFERENCE_RUNS: dict[str, list[dict[str, Any]]] = {}


def reference_run(kind: str, steps: int, **kwargs: Any) -> list[dict[str, Any]]:
    """:func:`run_training`, run once per pytest process for the same arguments (shared DDP references)."""
    key = repr((kind, steps, sorted(kwargs.items())))
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = run_training(kind, steps, **kwargs)
    return _REFERENCE_RUNS[key]


__all__ = ["MODULES", "Block", "LitLM", "make_strategy", "run_training", "train", "trainer_for"]
