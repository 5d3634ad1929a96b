"""Smoke test of examples/hf_causal_lm_lightning.py: a Hugging Face GPT-2 under the fully sharded strategy."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # installed by the "examples" extra that make test installs

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_causal_lm_lightning.py"


@pytest.mark.timeout(300)
def test_example_trains_and_saves_a_checkpoint_the_plain_model_loads(tmp_path: Path) -> None:
    saved = tmp_path / "gpt2.ckpt"
    tiny = "--steps 10 --layers 2 --width 32 --heads 2 --vocab 32 --seq-len 16 --batch-size 4 --lr 1e-2"
    command = [sys.executable, str(EXAMPLE), *tiny.split(), "--activation-checkpointing", "--save", str(saved)]
    # Lightning's default launcher re-runs the script once per extra device, as it does for users.
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = re.search(r"first loss ([\d.]+)\s+last loss ([\d.]+)", done.stdout)
    assert found, done.stdout[-2000:]
    assert float(found.group(2)) < float(found.group(1)) - 0.3

    checkpoint = torch.load(saved, weights_only=False)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    plain = transformers.GPT2LMHeadModel(config)
    plain.load_state_dict({k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items()}, strict=True)
