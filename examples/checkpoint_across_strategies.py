"""Save a checkpoint under one strategy and resume it under another, at another world size if you like.

Every strategy writes the same universal layout (parameters and optimizer state by the unwrapped model's names,
each rank its own shard), so no conversion step is needed. Train 6 steps under FSDP on 2 processes, then resume
under ZeRO-2 (OSS + ShardedDataParallel) and train 6 more::

    torchrun --nproc-per-node 2 examples/checkpoint_across_strategies.py --strategy fsdp --steps 6 --dir ckpt
    torchrun --nproc-per-node 2 examples/checkpoint_across_strategies.py --strategy zero2 --steps 12 --dir ckpt

Each run prints the step it starts from. ``shardkit checkpoint inspect ckpt`` shows what was saved.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from torch import nn

from shardkit.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, step_directory
from shardkit.distributed.device import select_device
from shardkit.nn import FullyShardedDataParallel, ShardedDataParallel
from shardkit.optim import OSS


def build(strategy: str, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    if strategy == "fsdp":
        model = FullyShardedDataParallel(model)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)
    if strategy == "zero2":
        optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)
        return ShardedDataParallel(model, optimizer), optimizer
    raise SystemExit(f"--strategy must be fsdp or zero2, got {strategy!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="fsdp", help="fsdp or zero2")
    parser.add_argument("--steps", type=int, default=6, help="train until this step")
    parser.add_argument("--dir", default="ckpt", help="the checkpoint folder (shared by every rank)")
    args = parser.parse_args()

    device = select_device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model, optimizer = build(args.strategy, device)
    start = 0
    if latest_checkpoint(args.dir) is not None:  # the newest complete, intact checkpoint
        start = load_checkpoint(args.dir, model=model, optimizer=optimizer).step + 1

    generator = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randn(8, 16, generator=generator).to(device)
    loss = torch.zeros(())
    for _ in range(start, args.steps):
        loss = nn.functional.mse_loss(model(data), data.sum(dim=1, keepdim=True))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if args.steps > start:
        save_checkpoint(step_directory(args.dir, args.steps - 1), step=args.steps - 1, model=model, optimizer=optimizer)
    if dist.get_rank() == 0:
        print(f"checkpoint: {args.strategy} started at step {start}, loss {loss.item():.4f} at step {args.steps - 1}")
    # Release the wrapped model (and with it the process groups it holds) before the group is destroyed: a
    # process that exits still holding them aborts now and then at interpreter exit (RELIABILITY.md, known).
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
