"""The fsdp benchmark program runs end to end (tiny model): every strategy trains to the same loss, and the
tracked memory has the shape ZeRO-3 promises. Timings are the benchmark's business, not asserted here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardkit.bench import fsdp as bench


def test_quick_fsdp_suite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fsdp.json"
    bench.run(["--quick", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "prefetch under comm_delay" in printed and "torch_fsdp2" in printed
    results = json.loads(out.read_text())["results"]
    speed = {r["name"]: r for r in results["speed"]}
    assert set(speed) == set(bench.DEFAULT_STRATEGIES)
    assert all(r["error"] is None for r in speed.values()), {n: r["error"] for n, r in speed.items()}
    final = {n: r["losses"][-1] for n, r in speed.items()}
    assert max(final.values()) - min(final.values()) < 1e-4, final
    memory = {m["name"]: m for m in results["memory"]}
    assert all(m["error"] is None for m in memory.values())

    def steady(name: str) -> int:
        return sum(memory[name]["steady"][c] for c in ("parameters", "gradients", "optimizer_state"))

    assert steady("fsdp") <= steady("ddp") // 2 * 1.01  # parameters, gradients, optimizer state: half per rank
    assert memory["fsdp"]["peak"] < memory["ddp"]["peak"]
    delay = [r["name"] for r in results["delay"] if r["error"] is None]
    assert delay == ["no prefetch", "BACKWARD_PRE", "BACKWARD_PRE + forward"]
