"""Bad checkpoints and bad pairings: each raises a clear error naming the file, key or size, and loads nothing.

After every refused load the model, optimizer and scaler are compared with a snapshot taken before it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rel_testlib import (
    Run,
    as_numpy,
    assert_unchanged,
    distcp_file,
    fsdp_model,
    full_state,
    plain_run,
    snapshot,
    stored_tensors,
    tiny_net,
    train,
)

from shardkit.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_directory,
    verify_checkpoint,
)
from shardkit.distributed import DummyProcessGroup
from shardkit.optim import OSS
from shardkit.strategies.registry import OptimizerSpec, get_strategy
from shardkit.testing import run_distributed
from testkit import bitwise_difference


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    run = plain_run(seed=0)
    return save_checkpoint(tmp_path / "ckpt", step=1, model=run.model, optimizer=run.optimizer, scaler=run.scaler)


def _refused(directory: Path, error: type, match: str, **kwargs: Any) -> str:
    """Load into a fresh plain run; the load must raise ``error`` and change nothing. Returns the message."""
    target = plain_run(seed=1)
    before = snapshot(target)
    with pytest.raises(error, match=match) as info:
        load_checkpoint(directory, model=target.model, optimizer=target.optimizer, scaler=target.scaler, **kwargs)
    assert_unchanged(target, before)
    return str(info.value)


def test_truncated_file_is_caught_by_its_size(saved: Path) -> None:
    shard = distcp_file(saved)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    message = _refused(saved, CorruptCheckpointError, "truncated")
    assert shard.name in message and "Load an earlier checkpoint" in message


def test_truncated_file_is_caught_by_the_index_without_verification(saved: Path) -> None:
    shard = distcp_file(saved)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert shard.name in _refused(saved, CorruptCheckpointError, "truncated", verify=False)


def test_flipped_byte_is_caught_by_its_digest(saved: Path) -> None:
    shard = distcp_file(saved)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size; torch.load alone might not notice a flipped weight
    shard.write_bytes(bytes(data))
    assert shard.name in _refused(saved, CorruptCheckpointError, "SHA-256")


def test_missing_file_is_named(saved: Path) -> None:
    (saved / "ranks" / "rank_00000.pt").unlink()
    assert "rank_00000.pt" in _refused(saved, CorruptCheckpointError, "missing")


def test_damaged_index_is_refused_and_skipped_by_latest(tmp_path: Path, saved: Path) -> None:
    run = plain_run(seed=0)
    newer = save_checkpoint(tmp_path / "newer", step=5, model=run.model, optimizer=run.optimizer, scaler=run.scaler)
    (newer / "meta.json").write_text('{"format": "shardkit-checkpoint", "step": ')  # a torn write
    _refused(newer, CorruptCheckpointError, "cannot be parsed")
    assert latest_checkpoint(tmp_path) == saved  # the damaged newer one is skipped
    meta = json.loads((saved / "meta.json").read_text())
    (saved / "meta.json").write_text(json.dumps({**meta, "format_version": 99}))
    _refused(saved, CorruptCheckpointError, "format version 99")


def test_checkpoint_of_a_model_with_other_shapes_names_the_keys(tmp_path: Path) -> None:
    wide = plain_run(seed=0, width=16)
    directory = save_checkpoint(tmp_path / "wide", step=1, model=wide.model, optimizer=wide.optimizer)
    target = plain_run(seed=1)
    before = snapshot(target)
    with pytest.raises(IncompatibleCheckpointError) as info:
        load_checkpoint(directory, model=target.model, optimizer=target.optimizer)
    assert "'3.weight' has shape (16, 8) in the checkpoint, the model needs (8, 8)" in str(info.value)
    assert "'5.weight'" in str(info.value) and "Nothing was loaded" in str(info.value)
    assert_unchanged(target, before)


def test_checkpoint_of_a_model_with_other_keys_names_them(tmp_path: Path) -> None:
    other = Run("plain", torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)), None)
    directory = save_checkpoint(tmp_path / "other", step=1, model=other.model)
    target = plain_run(seed=1)
    before = snapshot(target)
    with pytest.raises(IncompatibleCheckpointError) as info:
        load_checkpoint(directory, model=target.model)
    message = str(info.value)
    assert "missing keys '3.weight', '3.bias', '5.weight', '5.bias'" in message
    assert "unexpected keys '1.weight', '1.bias'" in message
    assert_unchanged(target, before)


def test_optimizer_state_of_other_param_groups_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    source = plain_run(seed=0)
    params = list(source.model.parameters())
    source.optimizer = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "lr": 0.5}], lr=0.01)
    saved = save_checkpoint(tmp_path / "two_groups", step=1, model=source.model, optimizer=source.optimizer)
    target = plain_run(seed=1)  # one group: it would have to hold two different saved settings
    before = snapshot(target)
    with pytest.raises(IncompatibleCheckpointError, match="saved with different settings"):
        load_checkpoint(saved, model=target.model, optimizer=target.optimizer)
    assert_unchanged(target, before)  # the model state was fine, but it was not loaded either


def test_missing_parts_and_other_strategies_are_refused(tmp_path: Path) -> None:
    bare = plain_run(seed=0)
    directory = save_checkpoint(tmp_path / "bare", step=1, model=bare.model)  # no optimizer, no scaler
    _refused(directory, IncompatibleCheckpointError, "holds no scaler state")
    target = plain_run(seed=1)
    before = snapshot(target)
    with pytest.raises(IncompatibleCheckpointError, match="holds no optimizer state"):
        load_checkpoint(directory, model=target.model, optimizer=target.optimizer)
    assert_unchanged(target, before)
    fsdp = fsdp_model(seed=0, group=DummyProcessGroup(rank=0, size=1))
    sharded = save_checkpoint(tmp_path / "fsdp", step=1, model=fsdp)
    load_checkpoint(sharded, model=target.model)  # the universal layout: any strategy reads any other's checkpoint
    assert bitwise_difference(dict(fsdp.state_dict()), dict(target.model.state_dict())) is None


# ----------------------------------------------------------------------------------- at two ranks
def _fsdp_and_oss_bad_inputs(rank: int, world_size: int, root: str) -> dict[str, Any]:
    root_path = Path(root)
    out: dict[str, Any] = {}
    run = Run("fsdp", fsdp_model(seed=0), None)
    run.optimizer = torch.optim.Adam(run.model.parameters(), lr=0.01)
    train(run, range(1), rank)
    directory = save_checkpoint(step_directory(root_path, 1), step=1, model=run.model, optimizer=run.optimizer)

    wide = fsdp_model(seed=1, width=16)  # another model: refused on both ranks, naming the key
    before = full_state(Run("fsdp", wide, None))
    try:
        load_checkpoint(directory, model=wide)
    except IncompatibleCheckpointError as err:
        out["wide"] = str(err)
    out["wide_unchanged"] = bitwise_difference(before, full_state(Run("fsdp", wide, None))) is None

    # Only rank 1's file is damaged and, without verification, only rank 1 notices: both must raise.
    rank_file = directory / "ranks" / "rank_00001.pt"
    if rank == 1:
        rank_file.write_bytes(rank_file.read_bytes()[:100])
    torch.distributed.barrier()
    try:
        load_checkpoint(directory, model=run.model, optimizer=run.optimizer, verify=False)
    except CorruptCheckpointError as err:
        out["one_rank_corrupt"] = str(err)

    # A local (per-rank flat shard) state dict saved by a single process does not fit two ranks.
    local = torch.load(root_path / "local_world1.pt", weights_only=True)
    before = full_state(run)
    try:
        run.model.load_local_state_dict(local)
    except ValueError as err:
        out["local"] = str(err)
    out["local_unchanged"] = bitwise_difference(before, full_state(run)) is None

    # OSS state saved by one process re-shards at two: each rank keeps the state of the parameters it owns.
    net = tiny_net(seed=5)
    opt = OSS(net.parameters(), optim=torch.optim.Adam, lr=0.01)
    load_checkpoint(root_path / "oss_world1", model=net, optimizer=opt)
    stored = stored_tensors(root_path / "oss_world1")
    position = {p: i for i, p in enumerate(net.parameters())}
    names = {p: name for name, p in net.named_parameters()}
    out["oss_owned"] = sorted(position[p] for p in opt.optim.state)
    out["oss_equal"] = all(
        torch.equal(opt.optim.state[p]["exp_avg"], stored[f"optim/{names[p]}/exp_avg"]) for p in opt.optim.state
    )
    out["oss_model"] = as_numpy(full_state(Run("plain", net, opt)))
    out["slowmo"] = _slowmo_gossip_in_flight(rank, root_path)
    return out


def _slowmo_gossip_in_flight(rank: int, root: Path) -> list[str]:
    """Overlapped gossip still in flight cannot be saved; eval() completes it, and then the save works."""
    sgd = OptimizerSpec(torch.optim.SGD, {"lr": 0.05})
    options = {"slowmo_base_algorithm": "sgp", "overlap": True}
    model, optimizer, after_step = get_strategy("slowmo").build(tiny_net(seed=0), sgd, None, options)
    run = Run("slowmo", model, optimizer, after_step=after_step)
    train(run, range(2), rank)
    seen = []
    try:
        save_checkpoint(root / "slowmo_overlap", step=2, model=model, optimizer=run.optimizer)
    except CheckpointError as err:
        seen.append(str(err))
    model.eval()
    saved = save_checkpoint(root / "slowmo_overlap", step=2, model=model, optimizer=run.optimizer)
    seen.append(verify_checkpoint(saved).strategy)
    return seen


def test_bad_inputs_at_two_ranks_fail_on_every_rank_and_change_nothing(tmp_path: Path) -> None:
    group = DummyProcessGroup(rank=0, size=1)
    single = fsdp_model(seed=0, group=group)
    torch.save(single.local_state_dict(), tmp_path / "local_world1.pt")
    net = tiny_net(seed=4)
    opt = OSS(net.parameters(), optim=torch.optim.Adam, group=group, lr=0.01)
    train(Run("oss", net, opt), range(2), rank=0)
    save_checkpoint(tmp_path / "oss_world1", step=2, model=net, optimizer=opt)

    results = run_distributed(_fsdp_and_oss_bad_inputs, 2, str(tmp_path), timeout_s=90)
    for rank, out in enumerate(results):
        assert "'3.weight' has shape (8, 8) in the checkpoint, the model needs (16, 8)" in out["wide"], rank
        assert out["wide_unchanged"] and out["local_unchanged"], rank
        assert "rank 1: CorruptCheckpointError" in out["one_rank_corrupt"], rank
        assert "rank_00001.pt" in out["one_rank_corrupt"] and "rank 0:" not in out["one_rank_corrupt"], rank
        assert "world_size': 1" in out["local"] and "same world size" in out["local"], rank
        assert out["oss_equal"], rank
        assert "gossip rounds in flight" in out["slowmo"][0] and "model.eval()" in out["slowmo"][0], rank
        assert out["slowmo"][1] == "slowmo", rank
        assert bitwise_difference(out_tensors(out["oss_model"]), {k: v for k, v in net.state_dict().items()}) is None
    owned = [results[0]["oss_owned"], results[1]["oss_owned"]]
    assert sorted(owned[0] + owned[1]) == list(range(6)) and owned[0] and owned[1]


def out_tensors(arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}
