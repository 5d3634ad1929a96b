"""``shardkit checkpoint import`` round trips: import, then ``load_checkpoint`` into a plain model gives the
source's weights (and optimizer state, where the source has it); export of the result gives them back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ck_tools_lib import ck_net, write_fairscale_shards
from safetensors.torch import load_file, save_file

from shardkit.checkpoint import load_checkpoint
from shardkit.checkpoint.cli import main
from shardkit.checkpoint.tools.inspect import inspect_checkpoint


def _fresh() -> torch.nn.Module:
    torch.manual_seed(99)  # other weights than ck_net(): a load that does nothing fails the comparison
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 3))


def _check_loaded(ck: Path, want: dict[str, torch.Tensor], step: int = 0) -> None:
    model = _fresh()
    info = load_checkpoint(ck, model=model)
    assert info.step == step
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("source", ["state-dict", "safetensors", "fairscale-shards", "fairscale-full"])
def test_import_then_load_equals_the_source(tmp_path: Path, source: str) -> None:
    net = ck_net()
    with torch.no_grad():
        net[1].running_var.uniform_(0.5, 2.0)
    sd = net.state_dict()
    if source == "state-dict":
        src = tmp_path / "pytorch_model.bin"
        torch.save(sd, src)
    elif source == "safetensors":
        src = tmp_path / "model.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, src)
    elif source == "fairscale-shards":
        src = tmp_path / "shards"
        src.mkdir()
        write_fairscale_shards(net, 3, src)
    else:
        src = tmp_path / "consolidated.pt"
        torch.save({"_fsdp_wrapped_module." + k: v for k, v in sd.items()}, src)
    ck = tmp_path / "ck"
    assert main(["import", str(src), str(ck), "--step", "12", "--format", source]) == 0
    _check_loaded(ck, sd, step=12)
    report = inspect_checkpoint(ck)
    assert report["verification"]["ok"] and (report["layout"], report["strategy"]) == ("universal", "import")
    assert main(["export", str(ck), str(tmp_path / "back.safetensors")]) == 0
    back = load_file(tmp_path / "back.safetensors")
    assert all(torch.equal(back[k], v) for k, v in sd.items())


def test_bad_sources_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["import", str(tmp_path / "missing.pt"), str(tmp_path / "ck")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["import", str(tmp_path / "empty"), str(tmp_path / "ck")]) == 2
    assert "pass --format" in capsys.readouterr().err
    torch.save([1, 2], tmp_path / "list.pt")
    assert main(["import", str(tmp_path / "list.pt"), str(tmp_path / "ck")]) == 2
    assert "state dict of tensors" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()
