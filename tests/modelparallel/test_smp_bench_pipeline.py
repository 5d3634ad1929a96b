"""The pipeline benchmark program runs (tiny settings) and its three strategies train identically."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardkit.bench import pipeline
from shardkit.bench.pipeline_settings import QUICK_LM, PipelineSettings


def test_quick_pipeline_suite_agrees_with_torch_pipelining(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """smp and torch's GPipe and 1F1B train alike; every row has a measured bubble, peak activation memory and the
    bytes each stage sent, and the bytes are what the cut's shapes predict."""
    out_json = tmp_path / "pipeline.json"
    pipeline.run(["--quick", "--json", str(out_json)])
    out = capfd.readouterr().out
    assert "torch 1F1B" in out and "bubble theory" in out and "smp placement" in out
    assert "sent MiB/stage" in out and "peak act. MiB/stage" in out
    rows = {row["name"]: row for row in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"smp", "torch GPipe", "torch 1F1B"}
    for name in ("torch GPipe", "torch 1F1B"):
        assert rows[name]["max_loss_diff_vs_smp"] <= 1e-5, rows[name]  # same weights, data and maths
    assert all(row["median_step_s"] > 0 for row in rows.values())
    for row in rows.values():
        assert 0.0 <= row["bubble_measured"] < 1.0 and len(row["bubble_per_stage"]) == 2, row
        assert all(0.0 <= b < 1.0 for b in row["bubble_per_stage"]), row
        assert len(row["peak_activation_mib"]) == 2 and all(mib > 0 for mib in row["peak_activation_mib"]), row
    # One cut, one tensor across it: per micro-batch stage 0 sends the (mb, seq, d_model) float32 activation
    # forward and stage 1 its gradient back; nothing else travels point to point.
    settings = PipelineSettings(lm=QUICK_LM)
    micro_batch = settings.global_batch // settings.microbatches
    one_tensor = micro_batch * QUICK_LM.seq_len * QUICK_LM.d_model * 4
    assert rows["smp"]["sent_bytes"] == [settings.microbatches * one_tensor] * 2
    assert rows["torch 1F1B"]["sent_bytes"] == rows["smp"]["sent_bytes"]  # the same messages, other order
    assert rows["torch GPipe"]["sent_bytes"] == rows["smp"]["sent_bytes"]
    # one meter for both: 1F1B holds the same micro-batches whoever runs it; GPipe holds all eight (1F1B: two)
    assert rows["torch 1F1B"]["peak_activation_mib"] == pytest.approx(rows["smp"]["peak_activation_mib"], rel=0.25)
    assert rows["torch GPipe"]["peak_activation_mib"][0] > 2 * rows["torch 1F1B"]["peak_activation_mib"][0]


def test_schedules_side_by_side_train_identically(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """--schedules runs smp's 1F1B, ZB-H1 and ZB-H2 in the same processes, each from the same weights: the same
    losses (the split backward's gradients are bit-identical), a bubble (measured, and predicted from the measured
    F/B/W times) and peak activation memory per stage each."""
    out_json = tmp_path / "schedules.json"
    schedules = "interleaved,zero_bubble,zero_bubble_h2"
    pipeline.run(["--quick", "--strategies", "smp", "--schedules", schedules, "--json", str(out_json)])
    out = capfd.readouterr().out
    assert "smp zero_bubble vs smp interleaved: bubble" in out and "bubble of its lists with these times" in out
    rows = {row["name"]: row for row in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"smp interleaved", "smp zero_bubble", "smp zero_bubble_h2"}
    for name in ("smp zero_bubble", "smp zero_bubble_h2"):
        assert rows[name]["max_loss_diff_vs_smp"] == 0.0
        assert all(ms["W"] > 0 for ms in rows[name]["action_ms"])
    assert all(ms["W"] == 0 and ms["B"] > 0 for ms in rows["smp interleaved"]["action_ms"])
    for row in rows.values():
        assert len(row["bubble_per_stage"]) == 2 and len(row["peak_activation_mib"]) == 2
        assert all(mib > 0 for mib in row["peak_activation_mib"]) and 0 <= row["bubble_predicted"] < 1
    memory = {name: row["peak_activation_mib"] for name, row in rows.items()}
    # ZB-H1's later stages hold up to p micro-batches as the first does under 1F1B, less each once B has run
    assert max(memory["smp zero_bubble"]) <= 1.05 * max(memory["smp interleaved"])
    assert memory["smp zero_bubble"][0] <= 1.05 * memory["smp interleaved"][0]  # the first stage postpones none
    for stage in range(2):
        assert rows["smp zero_bubble"]["peak_with_w_grads_mib"][stage] >= memory["smp zero_bubble"][stage]
    assert memory["smp zero_bubble_h2"][0] > memory["smp zero_bubble"][0]  # ZB-H2 holds more on the first stage
    # splitting the backward changes when the gradients travel, not what travels
    sent = [row["sent_bytes"] for row in rows.values()]
    assert all(s == sent[0] for s in sent) and all(b > 0 for b in sent[0]), sent


@pytest.mark.parametrize(
    ("chunking", "crossings"), [(["--virtual-stages", "2"], 3), (["--smp-pipeline", "zbv"], 2)], ids=["loop", "v"]
)
def test_chunked_schedules_train_as_torch_1f1b(
    chunking: list[str], crossings: int, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Virtual stages and ZBV run in the suite, beside torch's 1F1B on the same batches: the same losses. Each
    rank sends ``crossings`` tensors per micro-batch where torch's 1F1B sends one: in the loop placement of four
    chunks rank 0 sends forward from chunks 0 and 2 and back from chunk 2; in the V (chunks 0 and 3 on rank 0)
    forward from chunk 0 and back from chunk 3, while chunk 1 hands chunk 2 its output on rank 1."""
    out_json = tmp_path / "chunked.json"
    pipeline.run(["--quick", "--strategies", "smp,torch 1F1B", *chunking, "--json", str(out_json)])
    out = capfd.readouterr().out
    assert "smp placement (auto, 4 stages" in out  # four chunks for two stages
    rows = {row["name"]: row for row in json.loads(out_json.read_text())["rows"]}
    assert rows["torch 1F1B"]["max_loss_diff_vs_smp"] <= 1e-5, rows
    assert 0.0 <= rows["smp"]["bubble_measured"] < 1.0 and len(rows["smp"]["peak_activation_mib"]) == 2
    assert all(mib > 0 for mib in rows["smp"]["peak_activation_mib"])  # the chunks' forwards are measured too
    assert rows["smp"]["sent_bytes"] == [crossings * b for b in rows["torch 1F1B"]["sent_bytes"]], rows


def test_chunked_schedule_runs_alone() -> None:
    with pytest.raises(SystemExit):
        pipeline.run(["--quick", "--virtual-stages", "2", "--schedules", "interleaved,zero_bubble"])
    # DualPipeV cuts its own V of chunks as ZBV does (its run: test_smp_dualpipev's parity, the bench by hand)
    assert pipeline.PipelineSettings(smp_pipeline="dualpipev").smp_chunked
    with pytest.raises(SystemExit):
        pipeline.run(["--quick", "--schedules", "interleaved,dualpipev"])


def test_torch_meters_count_sends_and_time_waits_on_receives(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In place of torch's two P2P helpers (fakes here, on a fake clock): the bytes of the sends are counted, a
    wait on a batch holding a receive is time blocked, a wait on sends alone is not; torch's helpers are back
    afterwards. Where torch lacks the helpers every entry is None, and the report prints "-" and says why."""
    from torch.distributed.pipelining import schedules

    from shardkit.bench import pipeline_report, pipeline_torch_meters

    now = [0.0]
    monkeypatch.setattr(pipeline_torch_meters, "perf_counter", lambda: now[0])

    def fake_batch(ops: list[Any], desc: Any = None) -> list[object]:
        return [object() for _ in ops]

    def fake_wait(works: list[Any]) -> None:
        now[0] += 3.0 if works is send_works else 2.0

    originals = (schedules._batch_p2p, schedules._wait_batch_p2p)
    monkeypatch.setattr(pipeline_torch_meters, "pipelining_p2p", lambda: (fake_batch, fake_wait))
    meters = pipeline_torch_meters.TorchStepMeters()
    send = SimpleNamespace(op=dist.isend, tensor=torch.zeros(3, 5))
    recv = SimpleNamespace(op=dist.irecv, tensor=torch.zeros(7, dtype=torch.float64))
    with meters.step():
        send_works = schedules._batch_p2p([send, send])
        mixed_works = schedules._batch_p2p([send, recv])
        schedules._wait_batch_p2p(send_works)
        schedules._wait_batch_p2p(mixed_works)
    assert (schedules._batch_p2p, schedules._wait_batch_p2p) == originals
    assert meters.sent == [3 * 15 * 4] and meters.waits == [2.0 / 5.0]

    monkeypatch.setattr(pipeline_torch_meters, "pipelining_p2p", lambda: None)
    missing = pipeline_torch_meters.TorchStepMeters()
    with missing.step():
        pass
    assert missing.sent == [None] and missing.waits == [None]
    per_rank = [{"torch_sent": {"t": [None]}, "torch_wait": {"t": [None]}, "torch_peak_activation": {"t": 2**20}}]
    fields = pipeline_report._torch_fields("t", per_rank)
    assert fields["bubble_measured"] is None and "sent_bytes" not in fields and fields["peak_activation_mib"] == [1]
    row = pipeline_report.Row("torch 1F1B", "1F1B", 1.0, 1.0, 0.0, None, **fields)
    pipeline_report._print_column_notes([row])
    assert pipeline_torch_meters.P2P_MISSING in capsys.readouterr().out
