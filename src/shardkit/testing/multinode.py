"""Run a function as a real multi-node job on this machine: one torch elastic agent per "node", on 127.0.0.1.

:func:`run_nodes` starts ``nnodes`` agent processes, each the same machinery ``torchrun --nnodes N
--nproc-per-node M --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT`` runs on one machine of a cluster
(``torch.distributed.launcher.api.elastic_launch``). They meet in a c10d rendezvous, torch assigns node ranks and
the workers see exactly what they would on separate machines (``GROUP_RANK``, ``LOCAL_WORLD_SIZE``,
``LOCAL_RANK``...). Only the network is shared, so every byte still goes through gloo over TCP.

A timeout kills every agent with its workers; a failure raises :class:`MultiNodeError` with each agent's log
(its workers' output and tracebacks go there too).

Example::

    def train(cfg):                       # module-level: the workers import it
        dist.init_process_group("gloo")
        ...
        return losses

    per_rank = run_nodes(train, {"steps": 5}, nnodes=2, nproc_per_node=2)   # 4 results, in global rank order
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Union

from shardkit.distributed.health import report_failure
from shardkit.launch import free_port

#: Seconds a multi-node job may run before every agent is killed.
DEFAULT_TIMEOUT_S = float(os.environ.get("SHARDKIT_MULTINODE_TIMEOUT", "240"))
#: Seconds the other agents get to finish after one agent failed, before they are killed.
FAILURE_GRACE_S = 20.0
#: Characters of each agent's log shown in an error.
LOG_TAIL_CHARS = 4000
#: Where each worker leaves its traceback (the job's private temporary folder).
_FOLDER_VARIABLE = "SHARDKIT_NODES_FOLDER"
_LOG_PREFIX = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ [^\]]*\] ?", re.MULTILINE)


class MultiNodeError(AssertionError):
    """An agent failed, or the job outlived its timeout; the message holds every agent's log."""


Entrypoint = Union[Callable[..., Any], str]


def run_nodes(
    entrypoint: Entrypoint,
    *args: Any,
    nnodes: int = 2,
    nproc_per_node: Union[int, Sequence[int]] = 2,
    max_restarts: int = 0,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``entrypoint(*args)`` in ``nnodes`` x ``nproc_per_node`` workers under ``nnodes`` elastic agents.

    ``entrypoint`` is a module-level function or its ``"package.module:function"`` name; it and ``args`` must
    pickle. Workers find torchrun's environment, so ``dist.init_process_group("gloo")`` needs no arguments.
    ``max_restarts`` lets each agent restart its workers after a failure, as ``torchrun --max-restarts`` does
    (the other agents then restart theirs too, in a new rendezvous round). ``env`` adds variables for the
    agents and workers. ``nproc_per_node`` may list one count per node (unequal nodes, as torchrun allows, to
    test what refuses them). Returns every worker's return value in global rank order (from the last round).
    """
    per_node = [nproc_per_node] * nnodes if isinstance(nproc_per_node, int) else list(nproc_per_node)
    if nnodes < 1 or len(per_node) != nnodes or any(count < 1 for count in per_node):
        raise ValueError(
            f"run_nodes needs nnodes >= 1 and nproc_per_node >= 1 (one count, or one per node), got {nnodes} and "
            f"{nproc_per_node}"
        )
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    target = entrypoint if isinstance(entrypoint, str) else f"{entrypoint.__module__}:{entrypoint.__qualname__}"
    _resolve(target)  # fail here, not in every worker, when it cannot be imported
    with tempfile.TemporaryDirectory(prefix="shardkit-nodes-") as tmp:
        spec = {
            "target": target,
            "args": args,
            "nnodes": nnodes,
            "nproc_per_node": per_node,
            "max_restarts": max_restarts,
            "endpoint": f"127.0.0.1:{free_port()}",
            "run_id": f"shardkit-nodes-{uuid.uuid4().hex[:8]}",
            "start_method": start_method,
            "timeout_s": timeout_s,
        }
        spec_path = Path(tmp) / "spec.pkl"
        spec_path.write_bytes(pickle.dumps(spec))
        agents = [_start_agent(spec_path, node, Path(tmp), env or {}, max_restarts) for node in range(nnodes)]
        codes = _wait(agents, timeout_s)
        logs = [(Path(tmp) / f"agent{node}.log").read_text(errors="replace") for node in range(nnodes)]
        if any(code != 0 for code in codes):
            raise MultiNodeError(_describe(target, codes, logs, _worker_errors(Path(tmp)), timeout_s))
        results: dict[int, Any] = {}
        for node in range(nnodes):
            results.update(pickle.loads((Path(tmp) / f"result{node}.pkl").read_bytes()))
    world_size = sum(per_node)
    if sorted(results) != list(range(world_size)):
        raise MultiNodeError(f"{target}: expected results from ranks 0..{world_size - 1}, got ranks {sorted(results)}")
    return [results[rank] for rank in range(world_size)]


def _start_agent(spec_path: Path, node: int, tmp: Path, env: dict[str, str], max_restarts: int) -> subprocess.Popen:
    agent_env = dict(os.environ)
    # The workers import the entrypoint's module by name: give them the caller's import path.
    agent_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    agent_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for workers
    if max_restarts > 0:
        # Restarted workers must not reuse the rendezvous TCP store of the first round (pytorch/pytorch#135712).
        agent_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    agent_env.update(env)
    agent_env[_FOLDER_VARIABLE] = str(tmp)
    log = open(tmp / f"agent{node}.log", "wb")  # noqa: SIM115 - the agent writes it; closed after Popen
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "shardkit.testing.multinode", str(spec_path), str(node)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=agent_env,
            start_new_session=True,  # its own process group: a timeout kills the agent and its workers together
        )
    finally:
        log.close()


def _wait(agents: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Every agent's exit code; agents still running at the deadline (or long after another failed) are killed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [agent.poll() for agent in agents]
        if all(code is not None for code in codes):
            return codes
        if any(code not in (None, 0) for code in codes):
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        time.sleep(0.1)
    killed = [agent.poll() is None for agent in agents]
    for agent, kill in zip(agents, killed):
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
    for agent in agents:
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(10)
    return [None if kill else agent.returncode for agent, kill in zip(agents, killed)]


def _worker_errors(folder: Path) -> list[str]:
    """Every worker traceback the job left, earliest first, each headed by its rank and restart attempt."""
    records = []
    for path in folder.glob("error_rank*_attempt*.json"):
        with contextlib.suppress(ValueError, OSError):
            rank = path.name[len("error_rank") :].split("_")[0]
            records.append((rank, json.loads(path.read_text())))
    records.sort(key=lambda item: item[1]["time"])
    return [f"--- rank {rank} raised (attempt {rec['attempt']}):\n{rec['traceback'].rstrip()}" for rank, rec in records]


def _describe(target: str, codes: list[int | None], logs: list[str], errors: list[str], timeout_s: float) -> str:
    lines = [f"{target} failed as a {len(codes)}-node job:", *errors]
    for node, (code, log) in enumerate(zip(codes, logs)):
        state = f"exited with {code}" if code is not None else f"was killed after {timeout_s:.0f}s (hung or waiting)"
        log = _LOG_PREFIX.sub("", log)  # torch's "E1124 09:48:40.870000 22543 file.py:836] " on every line
        tail = log[-LOG_TAIL_CHARS:]
        lines.append(f"--- agent {node} {state}; its log{' (end)' if len(log) > len(tail) else ''}:\n{tail}")
    return "\n".join(lines)


def _resolve(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    if not name or "<locals>" in name:
        raise ValueError(f"run_nodes needs a module-level function (or 'package.module:function'), got {target!r}")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _call(target: str, *args: Any) -> Any:
    """What each worker runs: import the entrypoint by name and call it; a failure leaves its traceback in the
    job's folder (the agent's own summary keeps only one failing worker per node, often a victim of another's)."""
    try:
        return _resolve(target)(*args)
    except BaseException as err:
        report_failure(err)  # the other ranks' collective errors then name this rank
        folder = Path(os.environ[_FOLDER_VARIABLE])
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        record = {"time": time.time(), "attempt": attempt, "traceback": traceback.format_exc()}
        (folder / f"error_rank{os.environ.get('RANK', '?')}_attempt{attempt}.json").write_text(json.dumps(record))
        raise


def _agent_main(spec_path: str, node: int) -> None:
    """One node's agent: an elastic launch of ``nproc_per_node`` workers; writes their results for the parent."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    spec = pickle.loads(Path(spec_path).read_bytes())
    config = LaunchConfig(
        min_nodes=spec["nnodes"],
        max_nodes=spec["nnodes"],
        nproc_per_node=spec["nproc_per_node"][node],
        run_id=spec["run_id"],
        rdzv_backend="c10d",
        rdzv_endpoint=spec["endpoint"],
        rdzv_configs={"join_timeout": int(spec["timeout_s"])},
        max_restarts=spec["max_restarts"],
        monitor_interval=0.1,
        start_method=spec["start_method"],
    )
    results = elastic_launch(config, _call)(spec["target"], *spec["args"])
    (Path(spec_path).parent / f"result{node}.pkl").write_bytes(pickle.dumps(dict(results)))


if __name__ == "__main__":
    _agent_main(sys.argv[1], int(sys.argv[2]))
