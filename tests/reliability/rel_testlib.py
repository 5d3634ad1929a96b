"""Shared pieces of the reliability tests: one tiny model under every strategy, deterministic training, and the
entry point of the elastic fault-injection runs.

Every strategy trains the same 3-layer net with dropout (so resuming must restore the RNG states) on batches that
depend only on ``(step, data-parallel rank)``, so a resumed run can be compared bitwise with an uninterrupted one.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.strategies.options import nothing
from shardkit.strategies.registry import OptimizerSpec, get_strategy
from testkit import bitwise_difference, regression_batch, train_step, units_at

STRATEGIES = ("ddp", "oss", "oss_sdp", "fsdp", "smp", "slowmo")


def tiny_net(seed: int, width: int = 8) -> nn.Module:
    """Linear(6, 8) - ReLU - Dropout - Linear(8, width) - Tanh - Linear(width, 3)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.25), nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 3)
    )


def _sgd() -> OptimizerSpec:
    return OptimizerSpec(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})


def _adam() -> OptimizerSpec:
    return OptimizerSpec(torch.optim.Adam, {"lr": 0.01})


def _first_layer_unit(net: nn.Module) -> dict[str, Any]:
    return {"auto_wrap_policy": units_at(net[0])}


def _registry_entry(strategy: str, net: nn.Module) -> tuple[str, OptimizerSpec, dict[str, Any]]:
    """The registry strategy each strategy of these tests is, its optimizer and its options."""
    if strategy in ("ddp", "oss"):
        return ("ddp" if strategy == "ddp" else "oss_ddp"), _sgd(), {}
    if strategy == "oss_sdp":
        return "oss_sdp", _adam(), {}
    if strategy == "fsdp":
        return "fsdp", _adam(), _first_layer_unit(net)
    if strategy == "slowmo":
        return "slowmo", _sgd(), {"slowmo_base_algorithm": "sgp", "slowmo_frequency": 3, "slowmo_num_shards": 2}
    raise ValueError(f"unknown strategy {strategy}")


def fsdp_model(seed: int, width: int = 8, group: Any = None) -> nn.Module:
    """:func:`tiny_net` in FSDP (over ``group``), with its first layer in a nested unit."""
    net = tiny_net(seed, width=width)
    return get_strategy("fsdp").build(net, _adam(), group, _first_layer_unit(net))[0]


@dataclass
class Run:
    """A model under one strategy, with its optimizer, grad scaler and what runs after each optimizer step."""

    strategy: str
    model: Any
    optimizer: Any
    scaler: Optional[Any] = None
    after_step: Callable[[], None] = nothing


def build(strategy: str, seed: int) -> Run:
    """``strategy`` over :func:`tiny_net` (every rank must call it: wrappers synchronise at construction)."""
    if strategy == "smp":  # no registry entry: pipeline parallelism has an API of its own
        import shardkit.modelparallel as smp

        smp.init({"partitions": 2, "microbatches": 2})
        model = smp.DistributedModel(tiny_net(seed))
        return Run(strategy, model, smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05)))
    net = tiny_net(seed)
    name, optim, options = _registry_entry(strategy, net)
    model, optimizer, after_step = get_strategy(name).build(net, optim, None, options)
    scaler = None
    if strategy == "oss_sdp":  # ShardedDataParallel's gradients live on their owner ranks: the sharded scaler
        from shardkit.optim import ShardedGradScaler

        scaler = ShardedGradScaler(init_scale=2.0**10)
    return Run(strategy, model, optimizer, scaler, after_step)


def release(run: Run) -> None:
    """Forget process-wide state a strategy keeps (smp allows one model per process)."""
    if run.strategy == "smp":
        import shardkit.modelparallel as smp

        smp.reset()


def train(run: Run, steps: range, rank: int, poison_at: Optional[tuple[int, int]] = None) -> None:
    """Train ``run`` on ``steps``; ``poison_at=(step, rank)`` gives that rank an overflowing batch at that step
    (an inf in it). Each batch depends only on the step and the data-parallel rank."""
    smp_step = None
    if run.strategy == "smp":
        from testkit.smp import new_mse_step

        smp_step = new_mse_step()
    for step in steps:
        x, y = regression_batch(1000 * step + (0 if run.strategy == "smp" else rank), rows=4)
        if poison_at == (step, rank):
            x[0, 0] = float("inf")
        if smp_step is not None:
            run.optimizer.zero_grad()
            smp_step(run.model, x, y)
            run.optimizer.step()
            continue
        train_step(run.model, run.optimizer, lambda _, x=x, y=y: (x, y), scaler=run.scaler)
        run.after_step()


def full_state(run: Run) -> dict[str, torch.Tensor]:
    """The whole model's parameters and buffers as this rank sees them (collective for FSDP and smp)."""
    if run.strategy in ("ddp", "oss", "oss_sdp"):
        state = run.model.module.state_dict()
    else:
        state = run.model.state_dict()
    return {k: v.detach().clone().cpu() for k, v in state.items() if isinstance(v, torch.Tensor)}


def as_numpy(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Tensors sent back from a worker die with its shared memory; arrays travel by value."""
    return {k: v.numpy() for k, v in state.items()}


# ------------------------------------------------------------------------------------- elastic fault injection
def _watchdog(deadline: float) -> None:
    """Exit this worker if the whole run outlives ``deadline`` (wall clock): nothing may hang the suite."""

    def watch() -> None:
        while time.time() < deadline:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _die_once(marker: Path) -> None:
    """SIGKILL this process unless ``marker`` exists (created first, so the restarted run does not die again)."""
    if marker.exists():
        return
    fd = os.open(marker, os.O_CREAT | os.O_WRONLY)
    os.fsync(fd)
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_save_kill(kill: dict[str, Any]) -> None:
    """Make the next save_checkpoint die after writing its files ("digests") or its meta.json ("publish")."""
    from shardkit.checkpoint import api

    name = {"digests": "_digests", "publish": "_publish"}[kill["where"]]
    original = getattr(api, name)

    def dying(*args: Any, **kwargs: Any) -> Any:
        if kill["where"] == "publish":
            from shardkit.checkpoint.files import write_json_atomic

            write_json_atomic(args[0] / "meta.json", args[2].to_json())  # the index lands, the rename never does
        _die_once(Path(kill["marker"]))
        return original(*args, **kwargs)

    setattr(api, name, dying)


def elastic_train(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train ``cfg["strategy"]`` for ``cfg["steps"]`` steps, resuming from the latest checkpoint under
    ``cfg["root"]`` and saving every ``cfg["every"]`` steps; die by SIGKILL as ``cfg["kills"]`` says.

    Runs under torch's elastic agent (environment from torchrun) or under ``run_distributed`` (group already up).
    Each kill is ``{"step", "rank", "where": "train" | "digests" | "publish", "marker"}``.
    """
    from shardkit.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, step_directory

    _watchdog(cfg["deadline"])
    if not dist.is_initialized():
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    root = Path(cfg["root"])
    run = build(cfg["strategy"], seed=0)
    start = 0
    if latest_checkpoint(root) is not None:
        info = load_checkpoint(root, model=run.model, optimizer=run.optimizer, scaler=run.scaler)
        start = info.step + 1
        assert info.data_position == {"next_step": start}, info.data_position
    with open(root / f"starts_rank{rank}.txt", "a") as log:
        log.write(f"{start} {os.environ.get('TORCHELASTIC_RESTART_COUNT', '-')} {time.time():.1f}\n")
    for step in range(start, cfg["steps"]):
        for kill in cfg["kills"]:
            if kill["rank"] == rank and kill["step"] == step and kill["where"] == "train":
                _die_once(Path(kill["marker"]))
        train(run, range(step, step + 1), rank)
        if step % cfg["every"] == cfg["every"] - 1:
            for kill in cfg["kills"]:
                if kill["rank"] == rank and kill["step"] == step and kill["where"] != "train":
                    _arm_save_kill(kill)
            save_checkpoint(
                step_directory(root, step),
                step=step,
                model=run.model,
                optimizer=run.optimizer,
                scaler=run.scaler,
                data_position={"next_step": step + 1},
            )
    state = full_state(run)
    return {"rank": rank, "state": as_numpy(state) if rank == 0 else None}


# ------------------------------------------------------------------------------------- single-process helpers
def plain_run(seed: int, width: int = 8) -> Run:
    """The tiny net with Adam and a GradScaler in this process (no process group), trained one step."""
    model = tiny_net(seed, width=width)
    run = Run("plain", model, torch.optim.Adam(model.parameters(), lr=0.01), torch.amp.GradScaler("cpu"))
    train(run, range(1), rank=0)
    return run


def snapshot(run: Run) -> dict[str, Any]:
    """Deep copies of everything a failed load must leave untouched."""
    import copy

    return {
        "model": {k: v.clone() for k, v in run.model.state_dict().items()},
        "optimizer": copy.deepcopy(run.optimizer.state_dict()),
        "scaler": None if run.scaler is None else copy.deepcopy(run.scaler.state_dict()),
    }


def assert_unchanged(run: Run, before: dict[str, Any]) -> None:
    """The model, optimizer and scaler hold exactly what :func:`snapshot` saw."""
    now = snapshot(run)
    assert bitwise_difference(before["model"], now["model"]) is None
    assert _same(before["optimizer"], now["optimizer"]), "optimizer state changed"
    assert before["scaler"] == now["scaler"]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def rewrite_digests(directory: Path) -> None:
    """Re-record every file's size and SHA-256 in ``meta.json``, as an attacker who edits a checkpoint would."""
    import json

    from shardkit.checkpoint.files import sha256
    from shardkit.checkpoint.metadata import DIGEST_KEY, index_digest

    meta_path = directory / "meta.json"
    meta = json.loads(meta_path.read_text())
    for name in meta["files"]:
        file = directory / name
        meta["files"][name] = {"bytes": file.stat().st_size, "sha256": sha256(file)}
    meta[DIGEST_KEY] = index_digest(meta)  # the index's own digest is no signature: an attacker reseals it too
    meta_path.write_text(json.dumps(meta))


class RunsCode:
    """Unpickling this calls ``os.mkdir(marker)``: a stand-in for any code a malicious checkpoint would run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.marker,))


def stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every full tensor a checkpoint stores, by its key (``model/<fqn>``, ``optim/<fqn>/<state name>`` in the
    universal layout), read through the checkpoint tools' safe reader."""
    from shardkit.checkpoint.tools.store import CheckpointView

    view = CheckpointView.open(directory)
    return view.read_many(view.entries())


def distcp_file(directory: Path) -> Path:
    """The first ``.distcp`` data file of a universal checkpoint."""
    return sorted((directory / "dcp").glob("*.distcp"))[0]


def write_legacy_parts(directory: Path, adapter: Any, rank: int, data_position: Any = None) -> None:
    """This rank's part of a checkpoint in ``adapter``'s (pre-universal) layout: its files and its rank file."""
    from shardkit.checkpoint import rng
    from shardkit.checkpoint.files import write_torch

    directory.mkdir(parents=True, exist_ok=True)
    adapter.save(directory, rank)
    write_torch(directory / "ranks" / f"rank_{rank:05d}.pt", {"rng": rng.capture(), "data_position": data_position})


def publish_legacy(directory: Path, adapter: Any, *, step: int, world_size: int, has_optimizer: bool) -> None:
    """Rank 0: the common file and a ``meta.json`` listing every file, as save_checkpoint wrote them before the
    universal layout (so tests can check that such checkpoints still load)."""
    import shardkit
    from shardkit.checkpoint.files import write_json_atomic, write_torch
    from shardkit.checkpoint.metadata import META_FILE, CheckpointMeta, record_files

    write_torch(directory / "common.pt", {"scaler": None, "extra": None})
    files = record_files(directory)
    meta = CheckpointMeta(
        step=step,
        world_size=world_size,
        strategy=adapter.strategy,
        layout=adapter.layout,
        resizable=adapter.resizable,
        has_optimizer=has_optimizer,
        has_scaler=False,
        shardkit_version=shardkit.__version__,
        torch_version=torch.__version__,
        files=files,
    )
    write_json_atomic(directory / META_FILE, meta.to_json())
