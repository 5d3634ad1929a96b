"""``shardkit checkpoint export``: safetensors equal to the checkpoint's model, sharded with an index when large."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ck_tools_lib import fsdp_dcp_checkpoint, full_checkpoint, small_state, universal_checkpoint
from safetensors.torch import load_file

from shardkit.checkpoint.cli import main
from shardkit.checkpoint.tools.export import parse_size


def test_one_file_equals_the_model_and_leaves_optimizer_out(tmp_path: Path) -> None:
    model, optim = small_state()
    ck = universal_checkpoint(tmp_path / "ck", model, optim)
    assert main(["export", str(ck), str(tmp_path / "m.safetensors")]) == 0
    loaded = load_file(tmp_path / "m.safetensors")
    assert loaded.keys() == model.keys()
    for name, tensor in model.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype


def test_shards_with_index_and_bf16(tmp_path: Path) -> None:
    model, optim = small_state()
    ck = universal_checkpoint(tmp_path / "ck", model, optim)
    out = tmp_path / "out"
    assert main(["export", str(ck), str(out), "--max-shard-size", "100B", "--dtype", "bf16"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(files) == 2 and set(index["weight_map"].values()) == {f.name for f in files}
    # bf16: enc.weight 60 + enc.bias 12 bytes, then head.weight 36 + the int64 counter 8: two shards within 100 bytes
    merged: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(f)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 100 or len(part) == 1
        merged |= part
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    assert merged.keys() == model.keys()
    assert merged["enc.weight"].dtype == torch.bfloat16
    assert torch.equal(merged["enc.weight"], model["enc.weight"].to(torch.bfloat16))
    assert merged["norm.num_batches_tracked"].dtype == torch.int64  # integer buffers keep their type


@pytest.mark.parametrize("layout", ["full", "fsdp-dcp"])
def test_today_layouts_export(tmp_path: Path, layout: str) -> None:
    model, _ = small_state()
    make = full_checkpoint if layout == "full" else fsdp_dcp_checkpoint
    ck = make(tmp_path / "ck", model, {"state": {}, "param_groups": []})
    assert main(["export", str(ck), str(tmp_path / "dir")]) == 0
    loaded = load_file(tmp_path / "dir" / "model.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in model.items()) and loaded.keys() == model.keys()


def test_single_file_larger_than_the_bound_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model, optim = small_state()
    ck = universal_checkpoint(tmp_path / "ck", model, optim)
    assert main(["export", str(ck), str(tmp_path / "m.safetensors"), "--max-shard-size", "100B"]) == 2
    assert "export into a folder" in capsys.readouterr().err
    assert not (tmp_path / "m.safetensors").exists()


def test_parse_size() -> None:
    assert parse_size("2GB") == 2 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("1000") == 1000
    with pytest.raises(ValueError, match="not a positive size"):
        parse_size("lots")
