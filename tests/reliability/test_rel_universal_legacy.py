"""Checkpoints in the layouts written before the universal one ("full", "fsdp-dcp") still load.

The legacy files are written by the legacy adapters themselves (as ``save_checkpoint`` did), with the same
``meta.json`` and digests; loading goes through today's ``load_checkpoint``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from rel_testlib import fsdp_model, publish_legacy, tiny_net, write_legacy_parts
from universal_lib import build, optimizer_state, state, train

from shardkit.checkpoint import load_checkpoint
from shardkit.checkpoint.adapters import Adapter, PlainAdapter
from shardkit.checkpoint.adapters.fsdp_legacy import FSDPAdapter
from shardkit.distributed import DummyProcessGroup


def _write_legacy(directory: Path, adapter: Adapter, step: int, has_optimizer: bool) -> Path:
    """A complete checkpoint in ``adapter``'s layout, as save_checkpoint wrote them before the universal layout."""
    write_legacy_parts(directory, adapter, 0, data_position={"batch": step})
    publish_legacy(directory, adapter, step=step, world_size=1, has_optimizer=has_optimizer)
    return directory


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_full_layout_loads_into_plain(tmp_path: Path) -> None:
    source = build("plain", seed=0)
    train(source, range(2))
    directory = _write_legacy(tmp_path / "full", PlainAdapter(source.model, source.optimizer), 2, True)
    target = build("plain", seed=3)
    info = load_checkpoint(directory, model=target.model, optimizer=target.optimizer)
    assert (info.step, info.strategy, info.data_position) == (2, "plain", {"batch": 2})
    assert _same(state(source), state(target))
    saved, loaded = optimizer_state(source), optimizer_state(target)
    assert saved is not None and loaded is not None and saved.keys() == loaded.keys()
    assert all(_same(saved[n], loaded[n]) for n in saved)
    train(source, range(2, 3))
    train(target, range(2, 3))
    assert _same(state(source), state(target))  # the restored Adam state continues identically


def test_fsdp_dcp_layout_loads_into_fsdp(tmp_path: Path) -> None:
    group = DummyProcessGroup(rank=0, size=1)
    model = fsdp_model(seed=0, group=group)
    directory = _write_legacy(tmp_path / "fsdp", FSDPAdapter(model, None), 1, False)
    assert (directory / "model" / ".metadata").is_file()
    target = fsdp_model(seed=4, group=group)
    info = load_checkpoint(directory, model=target)
    assert info.strategy == "fsdp"
    expected = tiny_net(seed=0).state_dict()
    assert _same({k: v for k, v in target.state_dict().items()}, dict(expected))
