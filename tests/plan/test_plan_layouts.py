"""``shardkit plan --smp-layouts``: smp's 3-D layouts of a model (which factorisations smp's rules accept, planned
by running each one's real code), their per-rank memory and traffic, and the plans of pipeline 2 x tensor 2 x data 2
(8 processes), tensor 2 x sharded data 2 and pipeline 2 x tensor 2 with prescaled_batch against real runs."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from shardkit.models.smp_lm import smp_lm
from shardkit.plan.accuracy import compare
from shardkit.plan.cli import main
from shardkit.plan.layouts import Layout, SplitFacts, config_refusal, read_split_facts, smp_layouts
from shardkit.plan.workloads import Workload

#: A model of 3 layers whose heads (6) and feed-forward features (90) decide the tensor degrees.
FACTS = SplitFacts(3, (("attention heads", 6), ("feed-forward features", 90)))


def _shapes(layouts: list[Layout]) -> list[tuple[int, int, int, bool]]:
    return [(x.pipeline, x.tensor, x.data, x.sharded) for x in layouts]


def test_layouts_are_the_factorisations_smps_rules_accept() -> None:
    valid, refused = smp_layouts(12, FACTS)
    # pipeline <= 3 layers; tensor divides 6 heads and 90 features (1, 2, 3, 6); data is what is left
    expected = [(p, t, 12 // (p * t), False) for p in (1, 2, 3) for t in (1, 2, 3, 6) if 12 % (p * t) == 0]
    assert _shapes(valid) == expected
    assert "pp1 x tp4 x dp3 x12: tensor degree 4 does not divide the attention heads 6, feed-forward features 90" in (
        refused
    )
    assert "pp4 x tp1 x dp3 x12: pipeline degree 4 is more stages than the model's 3 layers" in refused
    assert len(valid) + len(refused) == 18  # every (pipeline, tensor) pair dividing 12, listed once
    sharded, _ = smp_layouts(12, FACTS, sharded=True)
    assert [x for x in sharded if x.sharded] == [Layout(p, t, d, True) for p, t, d, _ in expected if d > 1]
    prescaled, _ = smp_layouts(12, FACTS, prescaled=True)  # the tensor ranks sharing one batch, where there are some
    assert [x for x in prescaled if x.prescaled] == [
        Layout(p, t, d, prescaled=True) for p, t, d, _ in expected if t > 1
    ]
    assert "no nn.ModuleList" in SplitFacts(None).pipeline_problem(2) and not SplitFacts(None).pipeline_problem(1)
    unsplit, refused = smp_layouts(4, SplitFacts(4))  # nothing to split: no tensor degree above 1
    assert _shapes(unsplit) == [(1, 1, 4, False), (2, 1, 2, False), (4, 1, 1, False)]
    assert "pp1 x tp2 x dp2 x4: the model has no smp.nn tensor-parallel layers for tensor degree 2 to split" in refused


def test_layout_options_are_smps_config_for_the_same_global_batch() -> None:
    three_d = Layout(2, 2, 2).setting(batch_size=3)
    assert three_d.options == {"partitions": 2, "microbatches": 2, "pipeline": "interleaved",
                               "tensor_parallel_degree": 2, "ddp": True}  # fmt: skip
    assert three_d.batch_ranks == 2  # one replica feeds 2 x 3 sequences in 2 micro-batches (6 is not 4 x k)
    assert Layout(2, 1, 4).options(batch_size=2)["microbatches"] == 4
    assert Layout(4, 1, 1).options(batch_size=2) == {"partitions": 4, "microbatches": 8, "pipeline": "interleaved"}
    assert Layout(1, 2, 2, sharded=True).options(2)["sharded_data_parallel_degree"] == 2
    assert Layout(2, 2, 2, sharded=True).label == "pp2 x tp2 x dp2 (sharded)"
    shared = Layout(2, 2, 2, prescaled=True).setting(batch_size=2)  # a tensor pair feeds one batch: the same global
    assert shared.batch_ranks == 4 and shared.label == "pp2 x tp2 x dp2 (prescaled)"
    assert shared.options == {**three_d.options, "microbatches": 4, "prescaled_batch": True}
    # a config smp refuses is listed with smp's reason before anything runs
    assert config_refusal(three_d.options) == ""
    assert config_refusal({**three_d.options, "placement_strategy": "DPP"}).startswith("smp refuses the config: ")


@pytest.mark.single  # smp.init in this process (one process, no group)
def test_split_facts_are_read_from_the_model_built_at_degree_one() -> None:
    facts = read_split_facts(functools.partial(smp_lm, dim=48, heads=6, layers=3, intermediate=90))
    assert facts == FACTS


#: The smp LM's parameters (default sizes: vocabulary 256, width 64, 4 layers, feed-forward 256) and the part of
#: them its blocks split: per layer query/key/value with their biases, dense, dense1 with its bias, dense2.
FULL_PARAMS = 2 * 256 * 64 + 2 * 64 + 4 * (2 * 2 * 64 + 3 * (64 * 64 + 64) + 64 * 64 + 64 + 2 * 64 * 256 + 256 + 64)
SPLIT_PARAMS = 4 * (3 * (64 * 64 + 64) + 64 * 64 + 64 * 256 + 256 + 256 * 64)


def _estimates(path: Path) -> dict[str, dict[str, Any]]:
    return {row["setting"]: row for row in json.loads(path.read_text())["estimates"]}


@pytest.mark.single  # the planner's peerless world is a process group in this process
def test_command_plans_every_layout_with_memory_and_traffic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "layouts.json"
    argv = [
        "--lm",
        "smp",
        "--smp-layouts",
        "--smp-sharded",
        "--world-sizes",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
    ]
    assert main([*argv, "--backend", "gloo", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = _estimates(out)
    assert set(rows) == {"pp1 x tp1 x dp2", "pp1 x tp1 x dp2 (sharded)", "pp1 x tp2 x dp1", "pp2 x tp1 x dp1"}
    sharded = rows["pp1 x tp1 x dp2 (sharded)"]["state_breakdown"]["parameters"]
    assert sharded == rows["pp1 x tp1 x dp2"]["state_breakdown"]["parameters"] // 2  # smp's ZeRO-3 over 2 ranks
    assert all(row["device"] == "meta" for row in rows.values())  # smp.nn's layers are built on the meta device
    header = [cell.strip() for cell in text.splitlines()[0].split("|")]
    assert header[4:10] == ["peak/rank", "params", "grads", "optimizer", "activations", "other"]
    assert all(label in text for label in rows) and "TP sent" in text and "world size 2: recommended" in text
    for tensor in (1, 2):  # each rank holds 1/t of the blocks' split parameters, the rest whole (fp32)
        params = rows[f"pp1 x tp{tensor} x dp{2 // tensor}"]["state_breakdown"]["parameters"]
        assert params == 4 * (FULL_PARAMS - SPLIT_PARAMS + SPLIT_PARAMS // tensor)
    sent = {label: row["comm_bytes"] for label, row in rows.items()}
    # the tensor-parallel blocks gather and scatter their group's batches; the pipeline sends between stages
    assert sent["pp1 x tp2 x dp1"]["all_gather"] > 0 and "send" not in sent["pp1 x tp2 x dp1"]
    assert sent["pp2 x tp1 x dp1"]["send"] > 0 and "all_gather" not in sent["pp2 x tp1 x dp1"]
    assert rows["pp1 x tp2 x dp1"]["peak_bytes"] < rows["pp1 x tp1 x dp2"]["peak_bytes"]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--smp-sharded"], "give --smp-layouts too"),
        (["--smp-prescaled"], "--smp-prescaled adds variants of smp's layouts: give --smp-layouts too"),
        (["--smp-layouts", "--tensor-parallel", "2"], "drop --tensor-parallel"),
        (["--smp-layouts", "--strategies", "ddp"], "drop --strategies"),
    ],
)
def test_layout_flags_that_do_not_go_together_are_refused(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["--lm", "smp", *argv])
    assert match in capsys.readouterr().err


@pytest.mark.multi
@pytest.mark.parametrize(
    "layout",
    [Layout(2, 2, 2), Layout(1, 2, 2, sharded=True), Layout(2, 2, 1, prescaled=True)],
    ids=["pp2_tp2_dp2", "tp2_sdp2", "pp2_tp2_prescaled"],
)
def test_plan_of_a_layout_matches_a_real_run(layout: Layout) -> None:
    work = Workload.smp_lm(
        overrides={"vocab": 64, "dim": 32, "heads": 4, "layers": 4}, batch_size=2 * layout.replica_ranks, seq_len=16,
        strategy_options=layout.options(batch_size=2),
    )  # fmt: skip
    (row,) = compare(work, ["smp"], layout.world_size)
    assert abs(row.peak_error) <= 0.05, row.format()
    assert abs(row.state_error) <= 0.05, row.format()
    assert row.planned_comm == row.real_comm > 0, row.format()
