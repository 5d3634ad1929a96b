"""``shardkit demo --quick`` end to end: every available strategy trains, the loss falls towards the floor."""

import json
from pathlib import Path

import pytest

from shardkit.cli import main
from shardkit.demo.train import DemoSettings
from shardkit.strategies import registry as strategies


def test_demo_quick_trains_every_available_strategy(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    available, missing = strategies.select()
    out_json = tmp_path / "demo.json"
    assert main(["demo", "--quick", "--json", str(out_json)]) == 0
    out = capfd.readouterr().out
    rows = {line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")}
    assert {s.name for s in available} <= rows, out
    for name in missing:
        assert f"{name}: not available" in out

    payload = json.loads(out_json.read_text())
    floor, window = payload["floor"], payload["settings"]["eval_window"]
    assert 0 < floor < 2
    for result in payload["results"]:
        assert result["error"] is None, f"{result['name']} failed: {result['error']}"
        losses = result["losses"]
        assert len(losses) == payload["settings"]["steps"]
        final = sum(losses[-window:]) / window
        assert final < losses[0] - 0.5, f"{result['name']} did not learn: {losses[0]:.3f} -> {final:.3f}"
        assert final > floor - 0.1  # nobody beats the floor by more than batch noise


def test_learning_rate_schedule_warms_up_then_decays() -> None:
    settings = DemoSettings(strategies=("ddp",), lr=1.0, warmup_steps=10, steps=100, final_lr_fraction=0.1)
    lrs = [settings.lr_at(step) for step in range(100)]
    assert lrs[0] == pytest.approx(0.1 * (0.1 + 0.9 * 1.0))
    assert max(lrs) == pytest.approx(lrs[9])
    assert lrs[-1] == pytest.approx(0.1, abs=0.01)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_demo_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="unknown strategy 'nope'"):
        main(["demo", "--strategies", "ddp,nope"])
    with pytest.raises(SystemExit, match="--steps must be at least 1"):
        main(["demo", "--steps", "0"])
