"""Fault injection under torch's elastic agent: a 2-rank run is SIGKILLed at random steps, several times, including
in the middle of save_checkpoint; the agent restarts it, it resumes from the latest complete checkpoint, and it
ends with parameters bitwise-equal to an uninterrupted run. Every checkpoint left behind verifies.

The kill steps are drawn at random (the seed is in every assertion message; set SHARDKIT_REL_SEED to replay one).
Each worker dies at most once per planned kill: it creates the kill's marker file before SIGKILLing itself.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rel_testlib import elastic_train

from shardkit.checkpoint import latest_checkpoint, verify_checkpoint
from shardkit.launch import launch_local
from shardkit.testing import run_distributed
from testkit import bitwise_difference

STEPS, EVERY = 8, 2  # checkpoints after steps 1, 3, 5, 7
SAVE_STEPS = list(range(EVERY - 1, STEPS, EVERY))


def _kill_plan(rng: random.Random, root: Path, count: int) -> list[dict[str, Any]]:
    """``count`` kills at random steps and ranks: in training; inside save_checkpoint after its files are written
    but before its index; after the index but before the rename (rank 0 publishes); then more in training."""
    kinds = ["train", "digests", "publish"] + ["train"] * max(0, count - 3)
    train_steps = iter(rng.sample(range(1, STEPS), kinds.count("train")))
    kills = []
    for i, where in enumerate(kinds[:count]):
        step = next(train_steps) if where == "train" else rng.choice(SAVE_STEPS)
        rank = 0 if where == "publish" else rng.randrange(2)
        marker = str(root / f"kill{i}-{where}-step{step}-rank{rank}")
        kills.append({"where": where, "step": step, "rank": rank, "marker": marker})
    return kills


def _uninterrupted(rank: int, world_size: int, cfg: dict[str, Any]) -> dict[str, Any]:
    return elastic_train(cfg)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy,kills", [("oss_sdp", 2), ("fsdp", 3)])  # fsdp also dies at publish
def test_sigkilled_run_resumes_through_the_elastic_agent_to_identical_parameters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str, kills: int
) -> None:
    # launch_local itself must avoid pytorch/pytorch#135712 (restarted workers reading dead workers' addresses).
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    seed = int(os.environ.get("SHARDKIT_REL_SEED", random.randrange(2**31)))
    root = tmp_path / "killed"
    root.mkdir()
    plan = _kill_plan(random.Random(seed), tmp_path, kills)
    why = f"seed {seed}, plan {[(k['where'], k['step'], k['rank']) for k in plan]}"
    deadline = time.time() + 200  # every worker exits by then, so a hang cannot outlive the test
    cfg = {"strategy": strategy, "root": str(root), "steps": STEPS, "every": EVERY, "kills": plan, "deadline": deadline}
    killed = launch_local(elastic_train, 2, cfg, max_restarts=kills)

    reference_root = tmp_path / "reference"
    reference_root.mkdir()
    reference = run_distributed(_uninterrupted, 2, {**cfg, "root": str(reference_root), "kills": []}, timeout_s=120)

    assert all(Path(k["marker"]).exists() for k in plan), f"not every kill happened: {why}"
    starts = [line.split()[0] for line in (root / "starts_rank0.txt").read_text().splitlines()]
    assert len(starts) == kills + 1, f"{starts}: {why}"  # one restart per kill, each resuming
    resumed = {k: torch.from_numpy(v) for k, v in killed[0]["state"].items()}
    expected = {k: torch.from_numpy(v) for k, v in reference[0]["state"].items()}
    assert bitwise_difference(expected, resumed) is None, why

    complete = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [verify_checkpoint(p).step for p in complete] == SAVE_STEPS, why  # none is corrupt, none is missing
    assert latest_checkpoint(root) == complete[-1]
