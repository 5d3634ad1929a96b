"""shardkit bench plan --quick: the accuracy table runs and every row is within its bounds."""

from __future__ import annotations

import re

import pytest

from shardkit.bench import SUITES
from shardkit.bench.plan import run


def test_quick_accuracy_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert SUITES["plan"] == "shardkit.bench.plan"
    run(["--quick"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| demo LM |")]
    assert len(rows) == 7  # every strategy at world size 2, and FSDP with CPU offload
    assert any("| fsdp + cpu offload |" in row for row in rows)
    summary = re.search(r"largest peak error ([0-9.]+)%, largest state error ([0-9.]+)%, .*differ: (\d+)", out)
    assert summary is not None, out
    assert float(summary.group(1)) <= 10 and float(summary.group(2)) <= 10 and summary.group(3) == "0"


def test_hugging_face_families_build_their_task_heads_with_sdpa() -> None:
    import torch

    from shardkit.bench.plan import hf_families

    heads = {}
    for label, work in hf_families():
        with torch.device("meta"):
            model = work.build()
        heads[label.split(" (")[0]] = (type(model).__name__, model.config._attn_implementation)
    assert heads == {
        "BERT MLM": ("BertForMaskedLM", "sdpa"),
        "T5": ("T5ForConditionalGeneration", "sdpa"),
        "Llama GQA": ("LlamaForCausalLM", "sdpa"),
        "ViT": ("ViTForImageClassification", "sdpa"),
    }


def test_a_group_that_cannot_run_is_a_row_saying_why() -> None:
    from shardkit.bench.plan import _rows
    from shardkit.plan.workloads import Workload

    # A factory whose module does not exist: every group fails before any process starts.
    rows = _rows("broken", Workload("factory", "no_such_module:build"), 2)
    assert len(rows) == 3 and all(isinstance(r, str) and "did not run: " in r for r in rows)
