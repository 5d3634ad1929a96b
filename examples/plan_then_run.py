"""Plan a run with ``shardkit.plan.estimate``, run it, and compare the plan with what the run holds.

The planner runs one rank of the real strategy code on the meta device (nothing is allocated) and reports the
memory kept between steps, the peak and the traffic. The run then trains the same model under the same strategy
and measures the bytes each rank holds in parameters, gradients and optimizer state. Run on 2 processes::

    torchrun --nproc-per-node 2 examples/plan_then_run.py

The command-line planner answers the same question for every strategy at once, e.g.
``shardkit plan examples.plan_then_run:build_model --batch-shape 8,64 --world-sizes 2,8``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import shardkit.plan
from shardkit.memory.meter import format_bytes, training_memory
from shardkit.nn import FullyShardedDataParallel


def build_model() -> nn.Module:
    """The model both the plan and the run build (a module-level factory, as the planner wants)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def loss_fn(output: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return output.pow(2).mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    world_size = int(os.environ["WORLD_SIZE"])
    batch = (torch.randn(8, 64),)

    # 1. Plan, before the process group exists (inside a job the planner would start a child process).
    plan = shardkit.plan.estimate(
        build_model, batch, loss_fn=loss_fn, strategy="fsdp", world_size=world_size, backend="gloo"
    )

    # 2. Run the planned setting.
    dist.init_process_group("gloo")
    model = FullyShardedDataParallel(build_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(args.steps):
        loss_fn(model(*batch), batch).backward()
        optimizer.step()
    held = training_memory(model, optimizer).total  # after the step, gradients still present (as planned)
    optimizer.zero_grad()

    # 3. Compare.
    if dist.get_rank() == 0:
        ratio = plan.state_bytes / held
        print(f"plan: fsdp at world {world_size}: planned state {format_bytes(plan.state_bytes)}, ", end="")
        print(f"measured {format_bytes(held)} (x{ratio:.3f}); planned peak {format_bytes(plan.peak_bytes)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
