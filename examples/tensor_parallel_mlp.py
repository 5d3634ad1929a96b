"""Tensor parallelism: one MLP and its output layer split across 2 processes, trained with a vocab-parallel loss.

``ColumnParallelLinear`` keeps a slice of the output features on each rank, ``RowParallelLinear`` a slice of the
input features, so the pair needs one all-reduce per forward; the loss is computed from each rank's slice of the
logits without gathering them. fairscale's (and Llama's) ``fairscale.nn.model_parallel`` names are the same layers
under ``shardkit.nn.model_parallel``. Run on 2 local processes::

    torchrun --nproc-per-node 2 examples/tensor_parallel_mlp.py --steps 10
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from shardkit import tensor_parallel as tp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    state = tp.init_parallel_state(tensor=2)  # with 4 processes: 2 data-parallel replicas of a TP-2 model
    tp.model_parallel_manual_seed(1234, state.tp_rank)  # each rank initialises its own slices
    model = torch.nn.Sequential(
        tp.ColumnParallelLinear(32, 128, bias=False, gather_output=False),  # weight: this rank's (64, 32)
        torch.nn.SiLU(),
        tp.RowParallelLinear(
            128, 32, bias=False, input_is_parallel=True
        ),  # weight: this rank's (32, 64); one all-reduce
        tp.ColumnParallelLinear(32, 64, bias=False, gather_output=False),  # a 64-token vocabulary, split
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    generator = torch.Generator().manual_seed(0)  # every tensor-parallel rank must see the same batch
    x = torch.randn(16, 32, generator=generator)
    targets = torch.randint(0, 64, (16,), generator=generator)
    losses = []
    for _ in range(args.steps):
        loss = tp.vocab_parallel_cross_entropy(model(x), targets).mean()  # from this rank's slice of the logits
        loss.backward()
        tp.clip_grad_norm_(model, 1.0)  # the global norm, each split parameter counted once
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if dist.get_rank() == 0:
        print(f"tp: degree {state.tp_size}, first loss {losses[0]:.4f} last loss {losses[-1]:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
