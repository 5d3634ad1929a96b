"""Every script in examples/ runs, at toy size, as its guide shows it: under torchrun with 2 processes on gloo.

Each example prints one result line on rank 0; the test checks the line and what it says (loss fell, the resumed
run started at the saved step, the plan matched the run). The Lightning example has its own test
(tests/lightning/test_lightning_hf_example.py). A new example gets a row in ``RUNS``; ``test_every_example_runs``
fails on a script in examples/ without one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.launch import free_port

pytestmark = pytest.mark.multi  # every test but the listing launches torchrun with 2 processes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
#: Tested elsewhere: the Lightning example starts its own processes.
ELSEWHERE = {"hf_causal_lm_lightning.py": "tests/lightning/test_lightning_hf_example.py"}


def _run(command: list[str], cwd: Path, timeout_s: float = 240) -> str:
    """Run ``command`` to its end; it must succeed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "PYTHON": sys.executable}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _losses(out: str, label: str) -> tuple[float, float]:
    found = re.search(rf"{label}.*first loss ([\d.]+) last loss ([\d.]+)", out)
    assert found, out[-2000:]
    return float(found.group(1)), float(found.group(2))


def _torchrun(script: str, *args: str, cwd: Path) -> str:
    return _run([*TORCHRUN, str(EXAMPLES / script), *args], cwd)


RUNS = {
    "zero2_training.py": "test_zero2",
    "fsdp_hf_finetune.py": "test_fsdp_hf_finetune",
    "smp_pipeline_zero_bubble.py": "test_smp_zero_bubble",
    "slowmo_training.py": "test_slowmo",
    "checkpoint_across_strategies.py": "test_checkpoint_across_strategies",
    "plan_then_run.py": "test_plan_then_run",
    "multinode_two_nodes.sh": "test_multinode_two_nodes",
    "tensor_parallel_mlp.py": "test_tensor_parallel_mlp",
}


def test_every_example_runs() -> None:
    scripts = {p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh")}
    assert scripts == set(RUNS) | set(ELSEWHERE), "give each example in examples/ a test in this file"


def test_every_example_is_shown_in_a_guide() -> None:
    pages = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    unshown = [name for name in [*RUNS, *ELSEWHERE] if f"{{literalinclude}} ../../examples/{name}" not in pages]
    assert not unshown, f"examples no guide shows (literalinclude): {unshown}"


@pytest.mark.timeout(300)
def test_zero2(tmp_path: Path) -> None:
    first, last = _losses(_torchrun("zero2_training.py", "--steps", "8", cwd=tmp_path), "zero2: world 2")
    assert last < first


@pytest.mark.timeout(300)
def test_fsdp_hf_finetune(tmp_path: Path) -> None:
    out = _torchrun("fsdp_hf_finetune.py", "--steps", "6", cwd=tmp_path)
    assert "fsdp: 3 units, " in out  # two decoder blocks and the root
    first, last = _losses(out, "fsdp")
    assert last < first


@pytest.mark.timeout(300)
def test_smp_zero_bubble(tmp_path: Path) -> None:
    first, last = _losses(_torchrun("smp_pipeline_zero_bubble.py", "--steps", "6", cwd=tmp_path), "smp zero_bubble")
    assert last < first


@pytest.mark.timeout(300)
def test_slowmo(tmp_path: Path) -> None:
    out = _torchrun("slowmo_training.py", "--steps", "6", cwd=tmp_path)  # ends on a sync step (every third)
    first, last = _losses(out, "slowmo")
    assert last < first and "replicas equal after sync: True" in out


@pytest.mark.timeout(300)
def test_checkpoint_across_strategies(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    saved = _torchrun(
        "checkpoint_across_strategies.py", "--strategy", "fsdp", "--steps", "3", "--dir", folder, cwd=tmp_path
    )
    assert "fsdp started at step 0" in saved
    resumed = _torchrun(
        "checkpoint_across_strategies.py", "--strategy", "zero2", "--steps", "6", "--dir", folder, cwd=tmp_path
    )
    assert "zero2 started at step 3" in resumed
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000002", "step_00000005"]


@pytest.mark.timeout(300)
def test_plan_then_run(tmp_path: Path) -> None:
    out = _torchrun("plan_then_run.py", "--steps", "2", cwd=tmp_path)
    found = re.search(r"planned state .* measured .* \(x([\d.]+)\)", out)
    assert found, out[-2000:]
    assert abs(float(found.group(1)) - 1.0) < 0.05


@pytest.mark.timeout(300)
def test_multinode_two_nodes(tmp_path: Path) -> None:
    out = _run(["bash", str(EXAMPLES / "multinode_two_nodes.sh"), str(free_port()), "6"], tmp_path)
    first, last = _losses(out, "zero2: world 2")
    assert last < first


@pytest.mark.timeout(300)
def test_tensor_parallel_mlp(tmp_path: Path) -> None:
    first, last = _losses(_torchrun("tensor_parallel_mlp.py", "--steps", "6", cwd=tmp_path), "tp: degree 2")
    assert last < first
