"""The planner's smp settings over chunks: interleaved 1F1B over 2 and 4 virtual stages, ZBV and DualPipeV, each with
the bubble its schedule predicts beside 1F1B and the zero-bubble schedules; the ones a model cannot take say why."""

from __future__ import annotations

import pytest
import torch

from shardkit.modelparallel.schedules.virtual_schedules import bubble_fraction, schedule_grid
from shardkit.models.reference import LMConfig, TransformerLM
from shardkit.plan.api import estimate
from shardkit.plan.cli import pipeline_settings
from shardkit.plan.pipeline import model_blocks, pipeline_bubble


def test_chunked_settings_carry_their_predicted_bubble() -> None:
    settings, skipped = pipeline_settings(8, 2, blocks=32)
    assert skipped == []
    by_label = {s.label: s for s in settings}
    for p, m in ((2, 4), (4, 8), (8, 16)):
        for v in (2, 4):  # interleaved 1F1B over v chunks: (p-1)/(v*m+p-1)
            label = f"pipeline (smp, {v} virtual stages) {p} stages x {m} mb, bubble {(p - 1) / (v * m + p - 1):.0%}"
            assert by_label[label].options == {
                "partitions": p,
                "microbatches": m,
                "pipeline": "interleaved",
                "virtual_stages": v,
            }
        zbv = pipeline_bubble("zbv", p, m)
        assert zbv == pytest.approx(bubble_fraction(schedule_grid("zbv", p, 2, m)))
        # F, B and W one tick each: only the V's ramp, at most p idle ticks per rank against 6m of work.
        assert zbv <= p / (6 * m + p)
        assert zbv < pipeline_bubble("zero_bubble", p, m) < pipeline_bubble("interleaved", p, m)
        assert by_label[f"pipeline (smp ZBV) {p} stages x {m} mb, bubble {zbv:.0%}"].options["pipeline"] == "zbv"
        # DualPipeV on the same V: p - 1 idle ticks per rank, never more than ZBV.
        dual = pipeline_bubble("dualpipev", p, m)
        assert dual == pytest.approx((p - 1) / (6 * m + p - 1)) and dual <= zbv
        label = f"pipeline (smp DualPipeV) {p} stages x {m} mb, bubble {dual:.0%}"
        assert by_label[label].options == {
            "partitions": p,
            "microbatches": m,
            "pipeline": "dualpipev",
            "virtual_stages": 2,
        }
        # 1F1B, ZB-H1 and ZB-H2 are still offered beside them.
        assert f"pipeline (smp) {p} stages x {m} mb, bubble {(p - 1) / (m + p - 1):.0%}" in by_label
    assert len(settings) == 3 * 7


def test_settings_a_model_cannot_take_say_why() -> None:
    # Four layers: 2 stages x 4 chunks and anything over 4 stages would leave chunks unequal.
    settings, skipped = pipeline_settings(4, 2, blocks=4)
    labels = {s.label for s in settings}
    assert "pipeline (smp, 2 virtual stages) 2 stages x 4 mb, bubble 11%" in labels
    assert "pipeline (smp ZBV) 2 stages x 4 mb, bubble 4%" in labels
    assert "pipeline (smp DualPipeV) 2 stages x 4 mb, bubble 4%" in labels
    why = dict(line.split(": ", 1) for line in skipped)
    assert why["pipeline (smp, 4 virtual stages) 2 stages x 4 mb x4"].startswith(
        "the model's 4 layers do not split into 8 equal chunks (2 stages x 4 per rank)"
    )
    assert set(why) == {
        "pipeline (smp, 4 virtual stages) 2 stages x 4 mb x4",
        "pipeline (smp, 2 virtual stages) 4 stages x 8 mb x4",
        "pipeline (smp, 4 virtual stages) 4 stages x 8 mb x4",
        "pipeline (smp ZBV) 4 stages x 8 mb x4",
        "pipeline (smp DualPipeV) 4 stages x 8 mb x4",
    }
    # An odd batch per rank leaves one micro-batch per stage: ZBV needs 2 per stage to fill its V.
    _, skipped = pipeline_settings(2, 1, blocks=4)
    (line,) = [line for line in skipped if "ZBV" in line]
    assert line.startswith("pipeline (smp ZBV) 2 stages x 2 mb x2: ") and "needs at least 2 x partitions = 4" in line
    (line,) = [line for line in skipped if "DualPipeV" in line]
    assert line.startswith("pipeline (smp DualPipeV) 2 stages x 2 mb x2: ") and "'dualpipev' needs at least 2" in line
    # Unknown layer count (no ModuleList): only smp's own rules apply.
    settings, skipped = pipeline_settings(2, 2, blocks=None)
    assert skipped == [] and len(settings) == 7


def _lm() -> torch.nn.Module:
    torch.manual_seed(0)
    return TransformerLM(LMConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=4, seq_len=16))


def _loss(output: torch.Tensor, batch: object) -> torch.Tensor:
    return output.float().square().mean()


@pytest.mark.single  # the planner starts a one-rank process group for each stage's run
def test_a_chunked_setting_is_planned_with_its_bubble() -> None:
    """The planner really runs each stage of the chunked schedules and stretches the step by their bubble."""
    assert model_blocks(_lm()) == 4
    tokens = (torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0)),)
    steps = {}
    for name, options in {
        "1f1b": {"partitions": 2, "microbatches": 4},
        "v2": {"partitions": 2, "microbatches": 4, "virtual_stages": 2},
        "zbv": {"partitions": 2, "microbatches": 4, "pipeline": "zbv"},
    }.items():
        est = estimate(_lm, tokens, loss_fn=_loss, strategy="smp", world_size=2, strategy_options=options)
        assert est.peak_bytes > 0 and est.flops > 0
        steps[name] = est
    assert steps["v2"].notes[0] == "interleaved pipeline bubble 11.1% of the step (2 stages x 4 mb, 2 virtual stages)"
    assert steps["zbv"].notes[0] == "zbv pipeline bubble 4.0% of the step (2 stages x 4 mb)"
    # The same FLOPs per rank (each rank holds half the model either way).
    assert steps["v2"].flops == pytest.approx(steps["1f1b"].flops, rel=0.05)
