"""Universal checkpoints move between plain, DDP, OSS (under DDP) and OSS + ShardedDataParallel at world sizes 1, 2
and 4, and training continues exactly as the uninterrupted single-process run.

Chain of jobs: one process saves a plain run; a 2-rank job loads it into OSS + SDP and DDP and saves its own DDP, OSS
and OSS + SDP runs; a 4-rank job loads each of those into another family, and saves OSS + SDP; one process loads
that into the plain model. Every loaded state equals the reference at the save step, every continued run the
reference at the end. The model ties two weights (stored once) and Adam has two param groups.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from universal_lib import build, close, optimizer_state, reference, state, train

from shardkit.checkpoint import load_checkpoint, save_checkpoint, wait_for_checkpoint
from shardkit.checkpoint.universal.layout import SIDE_DIR
from shardkit.testing import run_distributed

SAVE_AT, TOTAL = 2, 4


def _continue(family_name: str, directory: Path) -> dict[str, Any]:
    """Load ``directory`` into a fresh ``family_name`` (another seed), check, train to ``TOTAL``."""
    family = build(family_name, seed=7)
    info = load_checkpoint(directory, model=family.model, optimizer=family.optimizer)
    loaded = state(family)
    steps = {n: float(s["step"]) for n, s in (optimizer_state(family) or {}).items()}
    train(family, range(SAVE_AT, TOTAL))
    return {
        "loaded": loaded,
        "final": state(family),
        "steps": steps,
        "saved_by": info.strategy,
        "size": info.world_size,
    }


def _save(family_name: str, root: Path, async_save: bool = False) -> Path:
    family = build(family_name, seed=0)
    train(family, range(SAVE_AT))
    size = torch.distributed.get_world_size() if family_name != "plain" else 1
    directory = root / f"{family_name}-w{size}"
    save_checkpoint(directory, step=SAVE_AT, model=family.model, optimizer=family.optimizer, async_save=async_save)
    return directory


def _two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    base = Path(root)
    out = {
        "oss_sdp<-plain": _continue("oss_sdp", base / "plain-w1"),
        "ddp<-plain": _continue("ddp", base / "plain-w1"),
    }
    for name in ("ddp", "oss", "oss_sdp"):
        _save(name, base, async_save=name == "oss")
    wait_for_checkpoint()
    return out


def _four_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    base = Path(root)
    out = {
        "oss_sdp<-ddp": _continue("oss_sdp", base / "ddp-w2"),
        "ddp<-oss_sdp": _continue("ddp", base / "oss_sdp-w2"),
        "oss<-oss": _continue("oss", base / "oss-w2"),
    }
    _save("oss_sdp", base)
    return out


def test_moves_between_families_and_world_sizes_continue_the_reference_run(tmp_path: Path) -> None:
    at_save, at_end = reference(0, SAVE_AT), reference(0, TOTAL)
    _save("plain", tmp_path)
    results = {2: run_distributed(_two_ranks, 2, str(tmp_path), timeout_s=120)}
    results[4] = run_distributed(_four_ranks, 4, str(tmp_path), timeout_s=180)
    results[1] = [{"plain<-oss_sdp": _continue("plain", tmp_path / "oss_sdp-w4")}]
    checked = 0
    for size, per_rank in results.items():
        for rank, cases in enumerate(per_rank):
            for case, got in cases.items():
                where = f"{case} at world size {size}, rank {rank}"
                assert close(got["loaded"], at_save) is None, (where, close(got["loaded"], at_save))
                assert close(got["final"], at_end) is None, (where, close(got["final"], at_end))
                assert set(got["steps"].values()) <= {float(SAVE_AT)}, where  # Adam's step came back per parameter
                checked += 1
    assert checked == 2 * 2 + 3 * 4 + 1
    # OSS at 4 ranks: each parameter's state sits with exactly one owner, and every trained parameter has one.
    owners = [set(r["oss<-oss"]["steps"]) for r in results[4]]
    assert sum(len(o) for o in owners) == len(set().union(*owners)) == 5  # a.weight (tied), a/b/out biases, out.weight
    # The tie is stored once, under the first name; each rank wrote its own side file, no pickles.
    side = json.loads((tmp_path / "ddp-w2" / SIDE_DIR / "rank_00001.json").read_text())
    assert "b.weight" not in side["groups"] and side["groups"]["a.bias"]["lr"] == 0.01
    assert side["groups"]["a.weight"]["betas"] == {"__tuple__": [0.9, 0.999]}
