"""The shardkit plan command: table, recommendation, JSON, plot and its errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardkit.cli import main as shardkit_main
from shardkit.plan.cli import main, parse_bytes


def _estimates(path: Path) -> list[dict[str, Any]]:
    """The estimates of a ``--json`` document."""
    rows: list[dict[str, Any]] = json.loads(path.read_text())["estimates"]
    return rows


def test_plans_every_setting_over_world_sizes_with_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    code = shardkit_main(
        ["plan", "--lm", "demo", "--batch-size", "2", "--world-sizes", "2,8", "--strategies", "ddp,fsdp",
         "--json", str(out_json), "--plot", str(out_png)]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "world size 8: recommended" in printed
    rows = _estimates(out_json)
    assert {(r["strategy"], r["world_size"]) for r in rows} == {(s, w) for s in ("ddp", "fsdp") for w in (2, 8)}
    fsdp = {r["world_size"]: r for r in rows if r["setting"] == "zero3 (fsdp, reshard)"}
    assert fsdp[8]["state_bytes"] < fsdp[2]["state_bytes"]
    bf16 = {r["world_size"]: r for r in rows if r["setting"] == "zero3 (fsdp, bf16 compute)"}
    # Gathered in bfloat16: half the bytes of an FP32 gather, the same FP32 shards between steps.
    assert bf16[8]["comm_bytes"]["all_gather"] * 2 == fsdp[8]["comm_bytes"]["all_gather"]
    assert bf16[8]["state_bytes"] == fsdp[8]["state_bytes"] and bf16[8]["peak_bytes"] < fsdp[8]["peak_bytes"]
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_offload_settings_report_host_memory_and_must_fit_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "plan.json"
    argv = ["--lm", "demo", "--batch-size", "1", "--world-sizes", "4", "--strategies", "ddp,fsdp",
            "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    rows = {r["setting"]: r for r in _estimates(out_json)}
    off, plain = rows["zero3 (fsdp) + cpu offload"], rows["zero3 (fsdp, reshard)"]
    assert (
        off["host"]["state_bytes"] > 0
        and off["state_bytes"] < plain["state_bytes"]
        and plain["host"]["state_bytes"] == 0
    )
    assert "cpu offload" in capsys.readouterr().out
    assert main([*argv, "--host-memory", "1KiB"]) == 0  # the offloaded state no longer fits on the host
    table = capsys.readouterr().out
    offload_lines = [line for line in table.splitlines() if "offload" in line and "recommended" not in line]
    assert offload_lines and all(line.endswith("no") for line in offload_lines)
    (recommended,) = [line for line in table.splitlines() if "recommended" in line]
    assert "offload" not in recommended.split(", the fastest")[0]  # (offload settings are listed as not fitting)


def test_nothing_fits_in_a_tiny_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--lm", "demo", "--batch-size", "1", "--strategies", "ddp", "--device-memory", "1KiB"]) == 0
    assert "nothing fits in" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--lm", "demo", "--world-sizes", "0"], "positive"),
        (["--lm", "demo", "--device-memory", "lots"], "not a size"),
        (["--lm", "demo", "--hf", "gpt2"], "exactly one model"),
        (["mypkg.models"], "package.module:factory"),
        (["mypkg.models:build"], "--batch-shape"),
        (["--lm", "demo", "--strategies", "zero9"], "no known strategy"),
        (["--lm", "demo", "--world-sizes", "12", "--nprocs-per-node", "8"], "divide every world size"),
    ],
)
def test_bad_arguments_exit_with_a_message(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


def test_parse_bytes() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("40 GB") == 40 * 10**9


def test_nodes_add_hybrid_settings_and_inter_node_bytes(tmp_path: Path) -> None:
    out_json = tmp_path / "plan.json"
    argv = ["--lm", "demo", "--batch-size", "2", "--world-sizes", "8", "--nprocs-per-node", "4",
            "--strategies", "fsdp", "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    rows = {r["setting"]: r for r in _estimates(out_json)}
    hybrid, full = rows["zero3 hybrid (fsdp)"], rows["zero3 (fsdp, reshard)"]
    assert hybrid["nprocs_per_node"] == 4
    # Hybrid sharding gathers inside the node: fewer bytes cross nodes, more state stays per rank.
    assert 0 < sum(hybrid["inter_node_bytes"].values()) < sum(full["inter_node_bytes"].values())
    assert hybrid["state_bytes"] > full["state_bytes"]
    # Hybrid with offload: the node's shard lives in host memory, and the same bytes cross nodes.
    offloaded = rows["zero3 hybrid (fsdp) + cpu offload"]
    assert offloaded["host"]["state_bytes"] + offloaded["state_bytes"] == hybrid["state_bytes"]
    assert offloaded["inter_node_bytes"] == hybrid["inter_node_bytes"]


def test_pipeline_settings_train_the_same_global_batch(tmp_path: Path) -> None:
    out_json = tmp_path / "plan.json"
    argv = ["--lm", "demo", "--batch-size", "2", "--world-sizes", "4", "--strategies", "smp", "--json", str(out_json)]
    assert main(argv) == 0
    rows = _estimates(out_json)
    labels = {r["setting"] for r in rows}
    assert labels == {  # 1F1B and the zero-bubble schedules, each with its predicted bubble
        "pipeline (smp) 2 stages x 4 mb, bubble 20%",
        "pipeline (smp ZB-H1) 2 stages x 4 mb, bubble 8%",
        "pipeline (smp ZB-H2) 2 stages x 4 mb, bubble 8%",
        "pipeline (smp) 4 stages x 8 mb, bubble 27%",
        "pipeline (smp ZB-H1) 4 stages x 8 mb, bubble 14%",
        "pipeline (smp ZB-H2) 4 stages x 8 mb, bubble 11%",
    }
    assert all("highest peak" in r["notes"][-1] for r in rows)
    # The schedules over chunks need more layers than the demo LM's two: listed as not planned, saying why.
    not_planned = json.loads(out_json.read_text())["not_planned"]
    assert (
        "pipeline (smp ZBV) 2 stages x 4 mb x4: the model's 2 layers do not split into 4 equal chunks (2 stages x 2 "
        "per rank): the longest chunk would pace the schedule"
    ) in not_planned
    assert sum("virtual stages" in line for line in not_planned) == 4
    by_label = {r["setting"]: r for r in rows}
    one_f_one_b, h1, h2 = (by_label[f"pipeline ({n}) 4 stages x 8 mb, bubble {b}"] for n, b in LABELS_4X8)
    # The bubble shortens the predicted step; ZB-H1 holds no more activations than 1F1B (largest stage), ZB-H2 more.
    assert h2["step_seconds"] < h1["step_seconds"] < one_f_one_b["step_seconds"]
    assert h1["peak_bytes"] <= one_f_one_b["peak_bytes"] * 1.05 < h2["peak_bytes"]


LABELS_4X8 = [("smp", "27%"), ("smp ZB-H1", "14%"), ("smp ZB-H2", "11%")]


def test_factory_model_with_batch_shape(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "shardkit.testing.models:TransformerLM",
        "--batch-shape",
        "2,16",
        "--strategies",
        "fsdp",
        "--world-sizes",
        "4",
    ]
    assert main(argv) == 0
    assert "world size 4: recommended zero3" in capsys.readouterr().out


def test_offload_is_recommended_when_nothing_else_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "plan.json"
    argv = ["--lm", "demo", "--batch-size", "1", "--world-sizes", "4", "--strategies", "ddp,fsdp"]
    assert main([*argv, "--json", str(out_json)]) == 0
    rows = _estimates(out_json)
    offloaded = min(r["peak_bytes"] for r in rows if r["host"]["state_bytes"])
    kept = min(r["peak_bytes"] for r in rows if not r["host"]["state_bytes"])
    assert offloaded < kept  # offload frees device memory
    capsys.readouterr()
    assert main([*argv, "--device-memory", str((offloaded + kept) // 2)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "recommended" in line]
    assert "offload" in line and "of host memory" in line and "do not fit (" in line


def test_hf_model_from_a_local_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=512).save_pretrained(tmp_path)
    out_json = tmp_path / "plan.json"
    argv = ["--hf", str(tmp_path / "config.json"), "n_layer=3", "--batch-size", "1", "--seq-len", "32",
            "--world-sizes", "2", "--strategies", "ddp", "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    (row,) = _estimates(out_json)
    # Three blocks of 64 wide (the override) and the 512 x 64 embedding, tied with the head: about 0.18 M parameters.
    params = 3 * (12 * 64 * 64 + 13 * 64) + 512 * 64 + 64 * 64 + 2 * 64
    assert row["state_breakdown"]["parameters"] == pytest.approx(params * 4, rel=0.05)
    capsys.readouterr()
    assert main(["--hf", str(tmp_path / "missing.json")]) == 2
    assert "neither a transformers model type nor a readable config.json" in capsys.readouterr().err


def test_the_optimizer_is_planned_by_name_with_its_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--lm", "demo", "--batch-size", "1", "--world-sizes", "2", "--strategies", "ddp", "--json"]
    states = {}
    for name, extra in (("adamw", []), ("sgd", ["--optimizer-options", "momentum=0.9"]), ("sgd", [])):
        out_json = tmp_path / f"{name}{len(extra)}.json"
        assert main([*argv, str(out_json), "--optimizer", name, *extra]) == 0
        (row,) = _estimates(out_json)
        states[name, bool(extra)] = row["state_breakdown"]
    params = states["adamw", False]["parameters"]
    assert states["adamw", False]["optimizer_state"] >= 2 * params  # two moments (and step counters)
    assert states["sgd", True]["optimizer_state"] == params  # one momentum buffer
    assert states["sgd", False]["optimizer_state"] == 0  # plain SGD keeps nothing
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--lm", "demo", "--optimizer", "lion"])
    assert "not a torch.optim optimizer" in capsys.readouterr().err
