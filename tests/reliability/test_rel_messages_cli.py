"""Issue 32, item 11: the command-line tools say what the user got wrong, not what a library underneath tripped on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardkit.checkpoint.cli import main as checkpoint_main
from shardkit.plan.cli import main as plan_main


def test_importing_a_file_that_is_no_checkpoint_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "random.bin"
    source.write_bytes(bytes([72, 11, 200, 7]) + bytes(range(256)))  # not a zip, not a pickle
    for extra in ([], ["--format", "state-dict"]):
        assert checkpoint_main(["import", str(source), str(tmp_path / "ck"), *extra]) == 2
        err = capsys.readouterr().err
        assert "is not a torch or safetensors checkpoint" in err and "48 0b c8 07" in err
        assert "pickled" not in err
    assert not (tmp_path / "ck").exists()


def test_a_real_state_dict_still_imports(tmp_path: Path) -> None:
    torch.save(torch.nn.Linear(2, 2).state_dict(), tmp_path / "model.bin")
    assert checkpoint_main(["import", str(tmp_path / "model.bin"), str(tmp_path / "ck")]) == 0


def test_a_factory_that_needs_arguments_is_refused_with_the_call_it_gets(capsys: pytest.CaptureFixture[str]) -> None:
    code = plan_main(["math:sqrt", "--batch-shape", "2,8"])
    assert code != 0
    err = capsys.readouterr().err
    assert "math:sqrt is called with no arguments" in err
    assert "def build() -> torch.nn.Module" in err
    assert "takes exactly one argument" not in err
