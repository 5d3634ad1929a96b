"""SlowMo for slow networks: LocalSGD averages the model every few steps, then a slow-momentum step.

``SlowMoDistributedDataParallel`` keeps fairscale's arguments. Gradients are averaged inside a node every step
(``nprocs_per_node`` processes), while the exchanges across nodes happen every ``localsgd_frequency`` steps.
Run on 2 local processes, each its own "node"::

    torchrun --nproc-per-node 2 examples/slowmo_training.py --steps 12
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from shardkit.distributed.device import select_device
from shardkit.nn.data_parallel import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()

    device = select_device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    model = SlowMoDistributedDataParallel(
        module,
        nprocs_per_node=1,  # here each process plays a node; on real nodes, torchrun's --nproc-per-node
        slowmo_base_algorithm=SlowMoBaseAlgorithm.LOCALSGD,
        localsgd_frequency=3,
        slowmo_momentum=0.5,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    generator = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randn(8, 16, generator=generator).to(device)  # each rank its own toy batch
    losses = []
    for _ in range(args.steps):
        loss = torch.nn.functional.mse_loss(model(data), data.sum(dim=1, keepdim=True))
        loss.backward()
        optimizer.step()
        model.perform_slowmo(optimizer)  # every third step: average across ranks, then the slow-momentum step
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights)
    if dist.get_rank() == 0:
        same = all(torch.allclose(gathered[0], other) for other in gathered)
        print(f"slowmo: first loss {losses[0]:.4f} last loss {losses[-1]:.4f}, replicas equal after sync: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
