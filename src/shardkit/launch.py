"""Start local multi-process jobs with torch's own elastic launcher (the machinery behind ``torchrun``).

Used by ``shardkit demo`` and ``shardkit bench`` so that every benchmarked strategy runs under the same
launcher users run in production; shardkit never manages worker processes by hand.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any, Callable

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous endpoint)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_local(
    entrypoint: Callable[..., Any],
    nprocs: int,
    *args: Any,
    max_restarts: int = 0,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``entrypoint(*args)`` in ``nprocs`` local worker processes started by torch's elastic agent.

    Workers find RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in their environment, as under torchrun, so
    ``torch.distributed.init_process_group()`` with no arguments works inside ``entrypoint``. Returns each
    rank's return value in rank order. ``entrypoint`` must be a module-level (picklable) function.

    Example::

        results = launch_local(train_one_strategy, 2, "oss_sdp")
    """
    if nprocs < 1:
        raise ValueError(f"launch_local needs nprocs >= 1, got {nprocs}")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"shardkit-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=start_method,
    )
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # torchrun's default for workers
    if max_restarts > 0:
        # Restarted workers must not reuse the rendezvous TCP store shared with the first round: it still holds
        # the dead workers' addresses and gloo's mesh setup then fails (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with _environment(env):
        results = elastic_launch(config, entrypoint)(*args)
    return [results[rank] for rank in range(nprocs)]


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables the agent and its workers inherit, restoring the caller's afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
