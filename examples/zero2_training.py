"""ZeRO-2 with shardkit: OSS shards the optimizer state, ShardedDataParallel reduces each gradient to its owner.

Run on 2 local processes (CPU, gloo)::

    torchrun --nproc-per-node 2 examples/zero2_training.py --steps 20

Every rank prints nothing but rank 0, which prints the first and last loss. ``--hybrid`` shards inside each node
and replicates across nodes (see examples/multinode_two_nodes.sh).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from shardkit.distributed import Topology
from shardkit.distributed.device import select_device
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim.oss import OSS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hybrid", action="store_true", help="shard inside each node, replicate across nodes")
    args = parser.parse_args()

    device = select_device()  # cuda:LOCAL_RANK under torchrun on GPUs, else cpu
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)

    group = Topology.from_env() if args.hybrid else None  # None: the whole world
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, group=group, lr=1e-2)
    model = ShardedDataParallel(model, optimizer)  # takes the optimizer's group

    generator = torch.Generator().manual_seed(dist.get_rank())  # each rank its own (toy) batch
    data = torch.randn(16, 32, generator=generator).to(device)
    target = data[:, :4].cumsum(dim=1)
    losses = []
    for _ in range(args.steps):
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()  # each gradient is reduced to the rank that owns its shard
        optimizer.step()  # each rank steps its shard, then the updated parameters are exchanged
        losses.append(loss.item())
    if dist.get_rank() == 0:
        print(f"zero2: world {dist.get_world_size()}, first loss {losses[0]:.4f} last loss {losses[-1]:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
