"""Bad universal checkpoints raise a clear error on every rank and change nothing.

One 2-rank job saves a DDP run, then loads damaged or unfitting checkpoints into DDP and OSS + ShardedDataParallel
models: another width (shapes), an extra layer (missing keys), another model (unexpected keys), a deleted
``.distcp`` shard, a truncated one, a ``.metadata`` index carrying pickled code. Each must raise the named error on
both ranks, leave model and optimizer bitwise as they were, and run no code.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from rel_testlib import RunsCode, rewrite_digests
from universal_lib import build, optimizer_state, param_groups, state, train

from shardkit.checkpoint import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from shardkit.testing import run_distributed


class Extra(torch.nn.Module):
    """Another small model: its keys are missing from, and unexpected in, the test net's checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Linear(6, 3)
        self.more = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.more(self.net(x))


def _copy(root: Path, name: str, damage: Callable[[Path], None], rank: int) -> Path:
    target = root / name
    if rank == 0:
        shutil.copytree(root / "good", target)
        damage(target)
    torch.distributed.barrier()
    return target


def _attempt(directory: Path, family_name: str, width: int = 6, verify: bool = True) -> dict[str, Any]:
    """Load into a fresh trained model; the result names the error and whether anything changed."""
    family = build(family_name, seed=5, width=width)
    train(family, range(1))
    before = (state(family), optimizer_state(family))
    try:
        load_checkpoint(directory, model=family.model, optimizer=family.optimizer, verify=verify)
        error = ("none", "")
    except Exception as err:  # the kind is checked by the test
        error = (type(err).__name__, str(err))
    after = (state(family), optimizer_state(family))
    same = all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and _same_optim(before[1], after[1])
    return {"error": error, "unchanged": same}


def _same_optim(a: Any, b: Any) -> bool:
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n]) for n in a
    )


def _job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    base = Path(root)
    family = build("ddp", seed=0)
    train(family, range(2))
    save_checkpoint(base / "good", step=2, model=family.model, optimizer=family.optimizer)
    marker = base / "ran"

    def delete_shard(d: Path) -> None:
        (d / "dcp" / "__1_0.distcp").unlink()

    def truncate(d: Path) -> None:
        shard = d / "dcp" / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:200])

    def plant(d: Path) -> None:
        (d / "dcp" / ".metadata").write_bytes(pickle.dumps(RunsCode(str(marker))))
        rewrite_digests(d)

    out = {
        "wide": _attempt(base / "good", "oss_sdp", width=7),
        "deleted": _attempt(_copy(base, "deleted", delete_shard, rank), "ddp", verify=False),
        "deleted_verified": _attempt(base / "deleted", "oss_sdp"),
        "truncated": _attempt(_copy(base, "truncated", truncate, rank), "oss_sdp", verify=False),
        "pickled": _attempt(_copy(base, "pickled", plant, rank), "ddp"),
    }
    extra = Extra()
    other = torch.optim.Adam(extra.parameters())
    save_checkpoint(base / "other", step=1, model=torch.nn.parallel.DistributedDataParallel(extra), optimizer=other)
    out["other"] = _attempt(base / "other", "ddp")
    target = torch.nn.parallel.DistributedDataParallel(Extra())
    before = {k: v.clone() for k, v in target.state_dict().items()}
    try:
        load_checkpoint(base / "good", model=target)
    except IncompatibleCheckpointError as err:
        out["missing"] = str(err)
    out["missing_unchanged"] = all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    out["ran"] = marker.exists()

    # Replicas whose buffers (or, without DDP, whole models) differ: the checkpoint keeps rank 0's copy.
    torch.manual_seed(0)
    bn = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    bn(torch.randn(8, 4) * (rank + 1))  # running statistics now differ between the ranks
    torch.manual_seed(rank)
    mine = torch.nn.Linear(4, 4)
    save_checkpoint(base / "bn", step=1, model=bn)
    save_checkpoint(base / "plain", step=1, model=mine)
    out["bn_mine"] = {k: v.clone() for k, v in bn.module.state_dict().items()}
    out["plain_mine"] = {k: v.clone() for k, v in mine.state_dict().items()}
    load_checkpoint(base / "bn", model=bn)
    load_checkpoint(base / "plain", model=mine)
    out["bn_loaded"] = {k: v.clone() for k, v in bn.module.state_dict().items()}
    out["plain_loaded"] = {k: v.clone() for k, v in mine.state_dict().items()}
    return out


def test_bad_universal_checkpoints_fail_on_every_rank_and_change_nothing(tmp_path: Path) -> None:
    results = run_distributed(_job, 2, str(tmp_path), timeout_s=120)
    for rank, out in enumerate(results):
        for case in ("wide", "deleted", "deleted_verified", "truncated", "pickled", "other"):
            assert out[case]["unchanged"], (rank, case)
        kind, message = out["wide"]["error"]
        assert kind == "IncompatibleCheckpointError", (rank, message)
        assert "'a.weight' has shape (6, 6) in the checkpoint, the model needs (7, 6)" in message
        kind, message = out["deleted"]["error"]
        assert kind == "CorruptCheckpointError" and "__1_0.distcp is missing" in message, (rank, message)
        kind, message = out["deleted_verified"]["error"]
        assert kind == "CorruptCheckpointError" and "__1_0.distcp is missing" in message, (rank, message)
        kind, message = out["truncated"]["error"]
        assert kind == "CorruptCheckpointError" and "truncated" in message, (rank, message)
        kind, message = out["pickled"]["error"]
        assert kind == "UnsafeCheckpointError" and "mkdir" in message, (rank, message)
        kind, message = out["other"]["error"]
        assert kind == "IncompatibleCheckpointError" and "unexpected keys 'net.weight', 'net.bias'" in message
        assert "missing keys 'gain', 'a.weight', 'a.bias'" in message, (rank, message)
        assert (
            "missing keys 'net.weight', 'net.bias', 'more.weight', 'more.bias'" in out["missing"]
            and out["missing_unchanged"]
        ), rank
        assert not out["ran"]
    for what in ("bn", "plain"):
        rank0, rank1 = results[0][f"{what}_mine"], results[1][f"{what}_mine"]
        assert any(not torch.equal(rank0[k], rank1[k]) for k in rank0), what  # the ranks really differed
        for out in results:
            assert all(torch.equal(out[f"{what}_loaded"][k], rank0[k]) for k in rank0), what


@pytest.mark.parametrize("what", ["settings", "no_index"])
def test_unfitting_optimizer_or_missing_index_is_refused_before_anything_loads(tmp_path: Path, what: str) -> None:
    source = build("plain", seed=0)
    train(source, range(2))
    directory = save_checkpoint(tmp_path / "c", step=2, model=source.model, optimizer=source.optimizer)
    target = build("plain", seed=1)
    if what == "settings":  # SGD's settings are not Adam's
        target.optimizer = torch.optim.SGD(param_groups(target.inner), lr=0.02, momentum=0.9)
        match, error = "settings do not fit this optimizer", IncompatibleCheckpointError
    else:  # the DCP store moved away: its index is missing
        target.optimizer = torch.optim.Adam(target.model.parameters())
        (tmp_path / "c" / "dcp").rename(tmp_path / "c" / "moved")
        match, error = "holds no DCP index", CorruptCheckpointError
    before = state(target)
    with pytest.raises(error, match=match):
        load_checkpoint(directory, model=target.model, optimizer=target.optimizer, verify=False)
    assert all(torch.equal(before[k], v) for k, v in state(target).items())
    assert not target.optimizer.state
