"""``shardkit bench``: suite selection, missing suites, option forwarding, and the zero suite end to end."""

import json
import sys
import types
from pathlib import Path

import pytest

from shardkit import bench
from shardkit.cli import main
from shardkit.strategies import registry as strategies


def test_unknown_suite_is_a_clear_error_listing_the_suites(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "zero", "nosuch"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown benchmark suite 'nosuch'" in err
    assert f"available suites: {', '.join(bench.SUITES)}" in err
    assert {"zero", "pipeline", "slowmo"} <= set(bench.SUITES)


def test_missing_suite_is_skipped_and_options_are_forwarded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[list[str]] = []
    fake = types.ModuleType("shardkit_test_fake_suite")
    fake.run = calls.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "shardkit_test_fake_suite", fake)
    monkeypatch.setattr(bench, "SUITES", {"fake": "shardkit_test_fake_suite", "later": "shardkit.bench.not_yet"})

    assert main(["bench", "--steps", "5", "--quick"]) == 0
    assert calls == [["--steps", "5", "--quick"]]
    assert "suite later not available yet" in capsys.readouterr().out


def test_a_failing_suite_does_not_stop_the_others(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(argv: list[str]) -> None:
        raise RuntimeError("boom")

    ran: list[list[str]] = []
    modules = {"shardkit_test_broken": broken, "shardkit_test_fine": ran.append}
    for module_name, run in modules.items():
        module = types.ModuleType(module_name)
        module.run = run  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module_name, module)
    monkeypatch.setattr(bench, "SUITES", {"broken": "shardkit_test_broken", "fine": "shardkit_test_fine"})
    assert main(["bench"]) == 1
    assert ran == [[]]
    assert "suite broken FAILED" in capsys.readouterr().out


def test_zero_suite_quick_runs_every_available_strategy(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    available, missing = strategies.select()
    out_json = tmp_path / "zero.json"
    assert main(["bench", "zero", "--quick", "--json", str(out_json)]) == 0
    out = capfd.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for strategy in available:
        assert strategy.name in rows, f"{strategy.name} missing from the table:\n{out}"
    for name in missing:
        assert f"{name}: not available" in out

    results = {r["name"]: r for r in json.loads(out_json.read_text())["results"]}
    ddp = results["ddp"]
    assert ddp["memory"]["params"] > 0 and ddp["comm_bytes_per_step"] > 0
    for name, result in results.items():
        assert result["error"] is None, f"{name} failed: {result['error']}"
        # Same weights, same batches: every strategy follows DDP's loss curve.
        assert result["losses"] == pytest.approx(ddp["losses"], abs=1e-4), name
        assert result["memory"]["params"] + result["memory"]["optim_state"] > 0
