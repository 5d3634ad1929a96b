"""``shardkit checkpoint inspect``: tensors, totals and verification, on the universal and today's layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ck_tools_lib import fsdp_dcp_checkpoint, full_checkpoint, small_state, universal_checkpoint

from shardkit.checkpoint.cli import main
from shardkit.checkpoint.tools.inspect import inspect_checkpoint


def _by_key(report: dict) -> dict:
    return {t["key"]: t for t in report["tensors"]}


def test_universal_lists_every_tensor_with_shape_dtype_bytes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model, optim = small_state()
    universal_checkpoint(tmp_path / "ck", model, optim)
    assert main(["inspect", str(tmp_path / "ck"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["layout"], report["step"], report["world_size"]) == ("universal", 3, 1)
    tensors = _by_key(report)
    assert set(tensors) == {f"model/{k}" for k in model} | {f"optim/{k}" for k in optim}
    assert tensors["model/enc.weight"] == {
        "key": "model/enc.weight",
        "part": "model",
        "shape": [6, 5],
        "dtype": "float32",
        "bytes": 120,
        "chunks": 1,
        "where": "dcp",
    }
    assert tensors["model/norm.num_batches_tracked"]["dtype"] == "int64"
    assert tensors["optim/enc.weight/step"]["part"] == "optimizer"
    totals = report["totals"]
    assert totals["by_part"]["model"] == {"tensors": 4, "bytes": 4 * (30 + 6 + 18) + 8}
    assert totals["parameters"] == 30 + 6 + 18 + 1
    assert report["verification"] == {"ok": True, "error": None}
    files = {f["name"]: f for f in report["files"]["list"]}
    assert "dcp/.metadata" in files and files["dcp/.metadata"]["bytes"] > 0
    assert report["files"]["bytes"] == sum(f["bytes"] for f in files.values())


def test_text_report_and_damaged_file_fails_verification(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model, optim = small_state()
    ck = universal_checkpoint(tmp_path / "ck", model, optim)
    assert main(["inspect", str(tmp_path)]) == 0  # the parent: the latest checkpoint under it
    text = capsys.readouterr().out
    assert "layout universal" in text and "model/enc.weight" in text and "verification: OK" in text
    shard = next((ck / "dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["inspect", str(ck)]) == 1
    assert "verification: FAILED" in capsys.readouterr().out
    assert inspect_checkpoint(ck, verify=False)["verification"]["ok"] is None


def test_today_layouts_full_and_fsdp_dcp(tmp_path: Path) -> None:
    model, _ = small_state()
    opt_state = {
        "state": {0: {"exp_avg": torch.zeros(6, 5), "step": torch.tensor(1.0)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    full = inspect_checkpoint(full_checkpoint(tmp_path / "full", model, opt_state))
    assert full["layout"] == "full" and full["verification"]["ok"]
    keys = _by_key(full)
    assert keys["enc.weight"]["shape"] == [6, 5] and keys["enc.weight"]["where"] == "model.pt"
    assert keys["state/0/exp_avg"]["part"] == "optimizer"
    fsdp = inspect_checkpoint(fsdp_dcp_checkpoint(tmp_path / "fsdp", model, opt_state))
    keys = _by_key(fsdp)
    assert keys["enc.weight"]["where"] == "model" and keys["enc.weight"]["part"] == "model"
    assert fsdp["totals"]["by_part"]["model"]["tensors"] == 4


def test_not_a_checkpoint_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_slowmo_per_rank_layout_shows_rank_zeros_model(tmp_path: Path) -> None:
    from ck_tools_lib import write_meta
    from safetensors.torch import load_file

    model, _ = small_state()
    ck = tmp_path / "ck"
    (ck / "slowmo").mkdir(parents=True)
    for rank in range(2):
        wrapper = {f"module.{k}": v + rank for k, v in model.items()} | {"ps_weight": torch.ones(())}
        torch.save(
            {"model": wrapper, "optimizer": {"state": {}, "param_groups": []}, "step": 3},
            ck / "slowmo" / f"rank_{rank:05d}.pt",
        )
    write_meta(ck, "per-rank", strategy="slowmo", world_size=2)
    report = inspect_checkpoint(ck)
    names = {t["key"]: t["part"] for t in report["tensors"]}
    assert names["model/module.enc.weight"] == "model" and names["model/ps_weight"] == "other"
    assert main(["export", str(ck), str(tmp_path / "m.safetensors")]) == 0
    exported = load_file(tmp_path / "m.safetensors")
    assert exported.keys() == model.keys()  # rank 0's copy, without the wrapper's module. level
    assert all(torch.equal(exported[k], v) for k, v in model.items())


def test_optimizer_settings_of_a_saved_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from shardkit.checkpoint import save_checkpoint

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam([{"params": net[0].parameters(), "lr": 0.1}, {"params": net[1].parameters()}], lr=0.01)
    net(torch.randn(2, 3)).sum().backward()
    opt.step()
    ck = save_checkpoint(tmp_path / "ck", step=1, model=net, optimizer=opt)
    report = inspect_checkpoint(ck)
    settings = sorted(
        (g["settings"]["lr"], g["parameters"], g["settings"]["betas"]) for g in report["optimizer_settings"]
    )
    assert settings == [(0.01, 2, [0.9, 0.999]), (0.1, 2, [0.9, 0.999])]
    assert main(["inspect", str(ck)]) == 0
    assert "optimizer settings of 2 parameters: amsgrad=False, betas=[0.9, 0.999]" in capsys.readouterr().out


class _Trap:
    def __reduce__(self):  # unpickling this would call print: a stand-in for code an attacker runs
        return (print, ("this must never run",))


def test_dcp_index_with_pickled_code_is_refused_unread(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import pickle

    model, optim = small_state()
    ck = universal_checkpoint(tmp_path / "ck", model, optim)
    (ck / "dcp" / ".metadata").write_bytes(pickle.dumps(_Trap()))
    assert main(["inspect", str(ck), "--no-verify"]) == 2
    captured = capsys.readouterr()
    assert "builtins.print" in captured.err and "refused unread" in captured.err
    assert "this must never run" not in captured.out
    assert main(["export", str(ck), str(tmp_path / "m.safetensors")]) == 2


def test_the_shardkit_command_delegates(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from shardkit.cli import main as shardkit_main

    model, optim = small_state()
    ck = universal_checkpoint(tmp_path / "ck", model, optim)
    assert shardkit_main(["checkpoint", "inspect", str(ck), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["tensors"] == 6
    with pytest.raises(SystemExit) as exited:
        shardkit_main(["checkpoint", "--help"])
    assert exited.value.code == 0 and "inspect" in capsys.readouterr().out
