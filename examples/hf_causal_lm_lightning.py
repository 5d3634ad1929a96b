"""Fine-tune a Hugging Face causal LM under PyTorch Lightning with shardkit's fully sharded strategy, on CPU.

The model is a GPT-2 randomly initialised from a small config (nothing is downloaded). The strategy cuts it into
one FullyShardedDataParallel unit per decoder block (``transformer_layer_cls=GPT2Block``), wraps the root around
the embeddings and the tied LM head, and can recompute each block's activations in backward
(``--activation-checkpointing``). The data is synthetic: every sequence counts up from a random start with a
random stride (mod the vocabulary), so the next token is predictable and the loss visibly falls.

Run (Lightning starts one process per device itself)::

    pip install 'shardkit[lightning]' transformers
    python examples/hf_causal_lm_lightning.py --devices 2 --steps 60 --activation-checkpointing

At the end, rank 0 prints the first and last training loss and saves a full checkpoint whose ``state_dict``
loads straight into an unwrapped ``GPT2LMHeadModel``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

import shardkit.lightning  # noqa: F401  (registers "shardkit_fsdp"; the instance below works without it)
from shardkit.lightning import DDPFullyShardedStrategy


class CountingSequences(Dataset):
    """``start, start+stride, start+2*stride, ...`` (mod ``vocab``): learnable next-token structure."""

    def __init__(self, vocab: int, seq_len: int, size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (size, 1), generator=gen)
        stride = torch.randint(1, 4, (size, 1), generator=gen)
        self.tokens = (start + stride * torch.arange(seq_len)) % vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


class CausalLM(pl.LightningModule):
    """A GPT-2 built in ``configure_model`` (so large models are created under the strategy's control)."""

    def __init__(
        self,
        layers: int,
        width: int,
        heads: int,
        vocab: int,
        seq_len: int,
        lr: float,
        batch_size: int,
        save: Optional[Path] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[torch.nn.Module] = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return  # configure_model runs again for validate/test; build once
        from transformers import GPT2Config, GPT2LMHeadModel

        hp = self.hparams
        config = GPT2Config(
            n_layer=hp.layers,
            n_embd=hp.width,
            n_head=hp.heads,
            vocab_size=hp.vocab,
            n_positions=hp.seq_len,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,
        )
        torch.manual_seed(0)  # every rank starts from the same random weights
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_train_end(self) -> None:
        if self.hparams.save is not None:
            self.trainer.save_checkpoint(self.hparams.save)  # every rank joins; rank 0 writes the full file
        if self.trainer.is_global_zero:
            first, last = self.losses[0], self.losses[-1]
            print(f"first loss {first:.3f}  last loss {last:.3f}  ({len(self.losses)} steps)", flush=True)

    def configure_optimizers(self) -> Any:
        # After wrapping, parameters are flat shards held by the wrapped model.
        return torch.optim.AdamW(self.trainer.model.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        return DataLoader(CountingSequences(hp.vocab, hp.seq_len, size=4096, seed=0), batch_size=hp.batch_size)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"])
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    parser.add_argument("--cpu-offload", action="store_true", help="keep parameter shards on the CPU")
    parser.add_argument("--start-method", default="popen", choices=["popen", "spawn", "fork", "forkserver"])
    parser.add_argument("--save", type=Path, default=None, help="write a full checkpoint here after training")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    pl.seed_everything(0, verbose=False)
    strategy = DDPFullyShardedStrategy(
        transformer_layer_cls=GPT2Block,  # one shard unit per decoder block
        activation_checkpointing=GPT2Block if args.activation_checkpointing else None,
        cpu_offload=args.cpu_offload,
        start_method=args.start_method,
    )
    hp = {k: getattr(args, k) for k in ("layers", "width", "heads", "vocab", "seq_len", "lr", "batch_size", "save")}
    model = CausalLM(**hp)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)


if __name__ == "__main__":
    main(sys.argv[1:])
