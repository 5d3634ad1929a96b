"""smp ("full") and SlowMo ("per-rank") checkpoints written before the universal layout still load, on two ranks.

The legacy files are written by the legacy adapters themselves, with ``meta.json`` and digests as
``save_checkpoint`` wrote them; loading goes through today's ``load_checkpoint``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from any_to_any_lib import build, release, train
from rel_testlib import publish_legacy, write_legacy_parts

from shardkit.checkpoint import load_checkpoint
from shardkit.checkpoint.adapters import Adapter
from shardkit.checkpoint.adapters.slowmo import SlowMoAdapter
from shardkit.checkpoint.adapters.smp import SMPAdapter
from shardkit.testing import run_distributed


def _write_legacy(directory: Path, adapter: Adapter, rank: int, world_size: int, step: int) -> None:
    """Every rank: the adapter's files and its rank file; rank 0 then the common file and meta.json."""
    write_legacy_parts(directory, adapter, rank)  # collective for smp (gathers the stages)
    dist.barrier()
    if rank == 0:
        publish_legacy(directory, adapter, step=step, world_size=world_size, has_optimizer=True)
    dist.barrier()


def _numpy(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone().numpy() for k, v in state.items() if isinstance(v, torch.Tensor)}


def _legacy_round_trips(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for family, adapter_cls in (("smp", SMPAdapter), ("slowmo", SlowMoAdapter)):
        directory = Path(root) / family
        source = build(family, rank, world_size, seed=0)
        train(source, range(2))
        _write_legacy(directory, adapter_cls(source.model, source.optimizer), rank, world_size, step=1)
        saved = _numpy(source.model.state_dict())  # smp: gathered over the stages; SlowMo: this rank's own
        train(source, range(2, 4))
        expected = _numpy(source.model.state_dict())
        release(source)
        target = build(family, rank, world_size, seed=1)
        info = load_checkpoint(directory, model=target.model, optimizer=target.optimizer)
        loaded = _numpy(target.model.state_dict())
        train(target, range(2, 4))
        out[family] = {
            "layout_strategy": info.strategy,
            "loaded_equal": _equal(saved, loaded),
            "continued_equal": _equal(expected, _numpy(target.model.state_dict())),
        }
        release(target)
    return out


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(torch.from_numpy(a[k]), torch.from_numpy(b[k])) for k in a)


def test_smp_full_and_slowmo_per_rank_layouts_still_load(tmp_path: Path) -> None:
    for rank, result in enumerate(run_distributed(_legacy_round_trips, 2, str(tmp_path), timeout_s=120)):
        for family in ("smp", "slowmo"):
            mine = result[family]
            assert mine["layout_strategy"] == family, f"rank {rank}"
            assert mine["loaded_equal"], f"rank {rank}: {family} did not load what it saved"
            # smp keeps a loaded optimizer state until the partition: continuing identically shows it arrived.
            assert mine["continued_equal"], f"rank {rank}: {family} did not continue identically"
