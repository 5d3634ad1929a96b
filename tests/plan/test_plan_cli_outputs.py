"""shardkit plan's outputs and inputs: the JSON document, the plot, a named loss, warnings once, clear errors."""

from __future__ import annotations

import json
import logging
import textwrap
import warnings
from pathlib import Path

import pytest

from shardkit.plan.cli import SETTINGS, main, plan_all
from shardkit.plan.cost import DeviceSpec, LinkSpec
from shardkit.plan.plot import draw
from shardkit.plan.workloads import Workload

DEMO = ["--lm", "demo", "--batch-size", "1"]


def test_json_carries_fits_recommendations_and_device_memory(tmp_path: Path) -> None:
    out_json = tmp_path / "plan.json"
    argv = [*DEMO, "--world-sizes", "2,4", "--strategies", "ddp,fsdp", "--json", str(out_json)]
    assert main([*argv, "--device-memory", "1GiB"]) == 0
    doc = json.loads(out_json.read_text())
    assert doc["device_memory_bytes"] == 2**30 and doc["host_memory_bytes"] == 256 * 2**30
    assert doc["world_sizes"] == [2, 4] and doc["backend"] == "nccl"
    assert all(row["fits"] for row in doc["estimates"])  # the demo LM is a few MiB
    by_world = {rec["world_size"]: rec for rec in doc["recommendations"]}
    assert set(by_world) == {2, 4}
    for world, rec in by_world.items():
        fastest = min(
            (r for r in doc["estimates"] if r["world_size"] == world and r["strategy"] != "slowmo"),
            key=lambda r: r["step_seconds"],
        )
        assert (rec["setting"], rec["peak_bytes"]) == (fastest["setting"], fastest["peak_bytes"])
        assert rec["text"].startswith(f"world size {world}: recommended {rec['setting']}")
    # Between the smallest and the largest peak: some settings fit, some do not, and the document says which.
    peaks = sorted(r["peak_bytes"] for r in doc["estimates"])
    limit = (peaks[0] + peaks[-1]) // 2
    assert main([*argv, "--device-memory", str(limit)]) == 0
    doc = json.loads(out_json.read_text())
    assert doc["device_memory_bytes"] == limit
    assert {r["fits"] for r in doc["estimates"]} == {True, False}
    assert all(r["fits"] == (r["peak_bytes"] <= limit and r["host"]["peak_bytes"] <= 256 * 2**30)
               for r in doc["estimates"])  # fmt: skip
    assert main([*argv, "--device-memory", "1KiB"]) == 0
    doc = json.loads(out_json.read_text())
    assert [rec["setting"] for rec in doc["recommendations"]] == [None, None]
    assert "nothing fits" in doc["recommendations"][0]["text"]


def test_plot_tells_which_settings_fit_at_a_glance(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    work = Workload.demo_lm(batch_size=1)
    settings = [s for s in SETTINGS if s.strategy in ("ddp", "oss_ddp", "oss_sdp", "fsdp", "slowmo")]
    results, failed = plan_all(work, [2, 4], settings, DeviceSpec(), LinkSpec())
    assert not failed and len({s.label for s, _ in results}) > 10  # more settings than tab10 has colours
    peaks = sorted(e.peak_bytes for _, e in results)
    limit = (peaks[0] + peaks[-1]) // 2
    fig = draw(results, limit, "demo LM")
    (ax,) = fig.axes
    setting_lines = [line for line in ax.get_lines() if line.get_label() in {s.label for s, _ in results}]
    looks = [(line.get_color(), line.get_linestyle(), line.get_marker()) for line in setting_lines]
    assert len(looks) == len({s.label for s, _ in results}) and len(set(looks)) == len(looks)
    assert len({(color, style) for color, style, _ in looks}) == len(looks)  # no repeated colour + line style
    (memory_line,) = [line for line in ax.get_lines() if line.get_label().startswith("device memory")]
    assert list(memory_line.get_ydata()) == [limit / 2**20] * 2  # a small model: drawn in MiB
    assert "demo LM" in ax.get_title() and "fits" in ax.get_title()
    # Hollow markers (white face) exactly for the points that do not fit.
    points = [line for line in ax.get_lines() if line.get_linestyle() == "None"]
    hollow = sum(line.get_markerfacecolor() == "white" for line in points)
    assert hollow == sum(not e.fits(limit) for _, e in results) > 0
    # The legend sits right of the axes, clear of every line.
    fig.canvas.draw()
    legend_box = ax.get_legend().get_window_extent()
    assert legend_box.x0 >= ax.get_window_extent().x1
    plt.close(fig)
    out = tmp_path / "plan.png"
    assert main([*DEMO, "--world-sizes", "2,4", "--strategies", "ddp,fsdp", "--plot", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def _peak(tmp_path: Path, loss: list[str]) -> int:
    out_json = tmp_path / "plan.json"
    argv = ["shardkit.testing.models:TransformerLM", "--batch-shape", "16,16", "--strategies", "ddp",
            "--world-sizes", "2", "--json", str(out_json), *loss]  # fmt: skip
    assert main(argv) == 0
    (row,) = json.loads(out_json.read_text())["estimates"]
    peak: int = row["peak_bytes"]
    return peak


def test_a_factory_loss_is_named_on_the_command_line(tmp_path: Path) -> None:
    mean = _peak(tmp_path, [])
    assert _peak(tmp_path, ["--loss", "mean"]) == mean
    cross_entropy = _peak(tmp_path, ["--loss", "cross_entropy"])
    assert cross_entropy > mean  # the log-softmax of the logits and its gradient
    by_path = _peak(tmp_path, ["--loss", "shardkit.plan.workloads:next_token_cross_entropy"])
    assert by_path == cross_entropy


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        ([*DEMO, "--loss", "hinge"], "not a known loss; choose mean"),
        ([*DEMO, "--loss", "no_such_pkg.losses:fn"], "cannot import 'no_such_pkg.losses'"),
        ([*DEMO, "--loss", "shardkit.plan.losses:nothing"], "has no 'nothing'"),
        ([*DEMO, "--loss", "shardkit.plan.losses:LOSSES"], "is a dict, not a function"),
        ([*DEMO, "--loss", "shardkit.plan.losses:resolve_loss"], "called as resolve_loss(output, batch)"),
        (["no_such_pkg.models:build", "--batch-shape", "2,8"], "model: cannot import 'no_such_pkg.models'"),
        (["shardkit.testing.models:Nothing", "--batch-shape", "2,8"], "has no 'Nothing'"),
        (["--hf", "not_a_model_type"], "neither a transformers model type"),
        (["--hf", "gpt2", "n_layers=2"], "has no field 'n_layers'"),
    ],
)
def test_bad_input_is_a_clear_error(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--world-sizes", "2", "--strategies", "ddp"]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        ([*DEMO, "--strategies", "ddp,fdsp"], "no known strategy 'fdsp'"),
        (["--lm", "demo", "--batch-size", "0"], "expected a positive integer"),
        ([*DEMO, "--json", "/no/such/folder/plan.json"], "does not exist"),
        ([*DEMO, "--plot", "plan.svg"], "give a .png path"),
    ],
)
def test_bad_arguments_are_refused_before_planning(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and match in capsys.readouterr().err


def test_a_local_bert_config_is_planned_as_a_masked_lm_with_each_warning_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers")  # transformers' handler exists, as it does once a model is built
    from transformers import BertConfig

    BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
               vocab_size=128).save_pretrained(tmp_path)  # fmt: skip
    work = Workload.hf(str(tmp_path), {}, batch_size=1, seq_len=16)
    assert work.task == "masked_lm" and type(work.build()).__name__ == "BertForMaskedLM"
    argv = ["--hf", str(tmp_path / "config.json"), "--batch-size", "1", "--seq-len", "16", "--world-sizes", "2,4",
            "--strategies", "ddp,fsdp"]  # fmt: skip
    capfd.readouterr()
    assert main(argv) == 0
    assert "BertLMHeadModel" not in capfd.readouterr().err
    # A model whose constructor warns (by transformers' logger and by warnings.warn) is built once per setting
    # and world size; each warning is printed once.
    (tmp_path / "noisy_model.py").write_text(
        textwrap.dedent(
            """
            import logging, warnings
            from shardkit.testing.models import LMConfig, TransformerLM

            def build():
                logging.getLogger("transformers.modeling_utils").warning("noisy: a transformers warning")
                warnings.warn("noisy: a Python warning", UserWarning)
                return TransformerLM(LMConfig.demo())
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    logged = _Records()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(logged)
    try:
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            argv = ["noisy_model:build", "--batch-shape", "1,16", "--world-sizes", "2,4", "--strategies", "ddp,fsdp"]
            assert main(argv) == 0
    finally:
        hf_logger.removeHandler(logged)
    assert [m for m in logged.messages if m.startswith("noisy")] == ["noisy: a transformers warning"]
    assert [str(w.message) for w in shown if "noisy" in str(w.message)] == ["noisy: a Python warning"]


class _Records(logging.Handler):
    """Keeps the messages it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_model_that_cannot_run_says_why_once_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    bert = "num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64"
    argv = ["--hf", "bert", bert, "--seq-len", "1024", "--batch-size", "1", "--world-sizes", "2,4",
            "--strategies", "ddp,oss_sdp"]  # fmt: skip
    assert main(argv) == 2
    captured = capsys.readouterr()
    (line,) = [line for line in captured.out.splitlines() if line.startswith("not planned: ddp")]
    assert line.startswith("not planned: ddp x2, zero2 (oss_sdp) x2, ddp x4, zero2 (oss_sdp) x4: ")
    assert "plan it with the override max_position_embeddings=1024" in line
    assert "no setting could be planned" in captured.err and "recommended" not in captured.out
