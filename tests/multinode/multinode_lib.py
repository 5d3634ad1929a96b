"""What the two-node tests run: every strategy in turn on a tiny net, then a checkpointed run that loses a worker.

:func:`train_every_strategy` is the entrypoint of one job. It runs the same way as 2 nodes x 2 processes under two
elastic agents and as 1 node x 4 processes under ``run_distributed``: same ranks, same data per rank, same global
batch, so the two runs must agree bit for bit. Each strategy's result is written to ``root`` as soon as it is
known, so when a worker dies in the checkpoint phase and the agents restart every worker, the restarted job skips
what is done and resumes the checkpointed run from its latest save.
"""

from __future__ import annotations

import os
import pickle
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from testkit import regression_batch, train_step

STEPS = 4
STRATEGIES = ("oss_ddp", "oss_sdp", "fsdp", "smp", "slowmo", "fsdp_restart")
CHECKPOINT_EVERY = 2  # saves after steps 1 and 3


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _plain_loop(model: nn.Module, opt: Any, steps: range, after_step: Callable[[], None] = lambda: None) -> list:
    losses = []
    for step in steps:
        batch = regression_batch(1000 * step + dist.get_rank(), rows=4)
        losses.append(train_step(model, opt, lambda _, batch=batch: batch))
        after_step()
    return losses


def _state(module: nn.Module) -> dict[str, Any]:
    return {k: v.detach().clone().numpy() for k, v in module.state_dict().items()}


def run_oss_ddp() -> dict[str, Any]:
    from shardkit.optim import OSS

    model = DDP(net())
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    return {"losses": _plain_loop(model, opt, range(STEPS)), "state": _state(model.module)}


def run_oss_sdp() -> dict[str, Any]:
    from shardkit.nn import ShardedDataParallel
    from shardkit.optim import OSS

    module = net()
    opt = OSS(module.parameters(), optim=torch.optim.Adam, lr=0.02)
    model = ShardedDataParallel(module, opt)
    return {"losses": _plain_loop(model, opt, range(STEPS)), "state": _state(module)}


def _fsdp_model() -> nn.Module:
    from shardkit.nn import FullyShardedDataParallel as FSDP

    model = net()
    model[0] = FSDP(model[0])
    return FSDP(model)


def run_fsdp() -> dict[str, Any]:
    model = _fsdp_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    losses = _plain_loop(model, opt, range(STEPS))
    return {"losses": losses, "state": _state(model)}


def run_smp() -> dict[str, Any]:
    import shardkit.modelparallel as smp
    from testkit.smp import new_mse_step

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True})
    model = smp.DistributedModel(net())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    step_fn = new_mse_step()
    losses = []
    for step in range(STEPS):
        x, y = regression_batch(1000 * step + smp.dp_rank(), rows=8)
        opt.zero_grad()
        losses.append(step_fn(model, x, y).reduce_mean().item())
        opt.step()
    placement = {
        "mp_group": sorted(dist.get_process_group_ranks(smp.get_mp_process_group())),
        "dp_group": sorted(dist.get_process_group_ranks(smp.get_dp_process_group())),
    }
    state = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    smp.reset()
    return {"losses": losses, "state": state, "placement": placement}


def run_slowmo() -> dict[str, Any]:
    from shardkit.nn.data_parallel import SlowMoDistributedDataParallel

    model = SlowMoDistributedDataParallel(net(), nprocs_per_node=2, localsgd_frequency=2, slowmo_frequency=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = _plain_loop(model, opt, range(STEPS), lambda: model.perform_slowmo(opt))
    return {"losses": losses, "state": _state(model.module)}


def run_fsdp_restart(root: Path, die_after_save: bool) -> dict[str, Any]:
    """FSDP saving every two steps; rank 3 SIGKILLs itself once, right after the first save."""
    from shardkit.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, step_directory

    checkpoints = root / "checkpoints"
    model = _fsdp_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    start = 0
    if latest_checkpoint(checkpoints) is not None:
        info = load_checkpoint(checkpoints, model=model, optimizer=opt)
        start = info.data_position["next_step"]
    losses = []
    for step in range(start, STEPS):
        losses += _plain_loop(model, opt, range(step, step + 1))
        if step % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1:
            save_checkpoint(
                step_directory(checkpoints, step), step=step, model=model, optimizer=opt,
                data_position={"next_step": step + 1},
            )  # fmt: skip
            marker = root / "killed"
            if die_after_save and dist.get_rank() == 3 and not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
    return {"losses": losses, "state": _state(model), "resumed_at": start}


def _meter_split(topo: Any) -> dict[str, int]:
    """Inter-node bytes of one all-reduce over everyone and one inside the node, as the comm meter counts them
    from torchrun's environment (no set_topology)."""
    from shardkit.distributed import collectives as C
    from shardkit.distributed import count_comm_bytes

    with count_comm_bytes() as world_meter:
        C.all_reduce(torch.ones(256), label="multinode.world")
    with count_comm_bytes() as node_meter:
        C.all_reduce(torch.ones(256), group=topo.intra_group, label="multinode.node")
    return {
        "world_wire": world_meter.total_wire_bytes,
        "world_inter": world_meter.total_inter_node_bytes,
        "node_inter": node_meter.total_inter_node_bytes,
    }


RUNNERS: dict[str, Callable[[], dict[str, Any]]] = {
    "oss_ddp": run_oss_ddp,
    "oss_sdp": run_oss_sdp,
    "fsdp": run_fsdp,
    "smp": run_smp,
    "slowmo": run_slowmo,
}


def train_every_strategy(cfg: dict[str, Any]) -> dict[str, Any]:
    """Entrypoint under the elastic agents: every strategy, each result saved under ``cfg["root"]`` at once."""
    from shardkit.distributed import Topology

    if not dist.is_initialized():
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    root = Path(cfg["root"])
    topo = Topology.from_env()
    out: dict[str, Any] = {
        "layout": topo.layout.nodes,
        "node_rank": topo.node_rank,
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "meter": _meter_split(topo),
    }
    for name in STRATEGIES:
        done = root / f"{name}_rank{rank}.pkl"
        if done.exists():
            out[name] = pickle.loads(done.read_bytes())
            continue
        if name == "fsdp_restart":
            result = run_fsdp_restart(root, cfg["die_after_save"])
        else:
            result = RUNNERS[name]()
        done.write_bytes(pickle.dumps(result))
        out[name] = result
    return out


def one_node(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """The same job on one node (``run_distributed``: 4 processes, LOCAL_WORLD_SIZE=4)."""
    return train_every_strategy(cfg)


def fail_on_rank_three() -> int:
    """Rank 3 raises; the others wait in a barrier that can never complete."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    if dist.get_rank() == 3:
        raise RuntimeError("rank three refuses to train")
    dist.barrier()
    return 0


def never_return() -> None:
    dist.init_process_group("gloo")
    import time

    time.sleep(600)


def topology_refusal() -> str:
    """Build the topology on nodes of unequal size; return the error every rank must raise."""
    from shardkit.distributed import Topology

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    try:
        Topology.from_env()
    except ValueError as err:
        message = str(err)
    else:
        message = "no error"
    dist.barrier()  # every rank is still in step: nobody is left inside a group creation
    return message
