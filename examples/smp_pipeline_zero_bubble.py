"""A two-stage pipeline with the smp API and the zero-bubble schedule (ZB-H1), as a SageMaker script runs it.

``import shardkit.modelparallel as smp`` replaces ``import smdistributed.modelparallel.torch as smp``; the rest
is smp's API. ``"pipeline": "zero_bubble"`` splits each backward into its input-gradient part, sent upstream at
once, and its weight-gradient part, run later to fill the pipeline's idle time. Run on 2 local processes::

    torchrun --nproc-per-node 2 examples/smp_pipeline_zero_bubble.py --steps 10

Other schedules: ``--pipeline interleaved`` (1F1B), ``zero_bubble_h2``, ``zbv`` and ``dualpipev`` (two chunks
per rank in a V; these need ``--blocks`` divisible by 4).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import shardkit.modelparallel as smp


class Net(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(blocks)])
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


@smp.step
def train_step(model: smp.DistributedModel, data: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(data), target)  # runs once per micro-batch, each stage its own part
    model.backward(loss)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pipeline", default="zero_bubble")
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()

    smp.init({"partitions": 2, "microbatches": 4, "pipeline": args.pipeline})
    torch.manual_seed(0)
    model = smp.DistributedModel(Net(args.blocks))  # partitioned over the 2 stages at the first step
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))

    generator = torch.Generator().manual_seed(0)
    data = torch.randn(16, 32, generator=generator)  # one toy batch, seen every step
    target = data.sum(dim=1, keepdim=True).tanh()
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = train_step(model, data, target).reduce_mean()  # mean over the 4 micro-batches
        optimizer.step()
        losses.append(loss.item())
    if smp.rank() == 0:
        print(f"smp {args.pipeline}: {smp.pp_size()} stages, first loss {losses[0]:.4f} last loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
