"""``shardkit checkpoint export --hf``: a save_pretrained folder that transformers loads with the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ck_tools_lib import universal_checkpoint

from shardkit.checkpoint.cli import main

transformers = pytest.importorskip("transformers")

OVERRIDES = "n_layer=2,n_embd=32,n_head=2,vocab_size=61,n_positions=16"


def _trained_gpt2() -> torch.nn.Module:
    config = transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=61, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 61, (2, 12))
    for _ in range(2):
        model(tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def test_hf_folder_gives_the_trained_models_logits(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from shardkit.checkpoint import save_checkpoint

    model = _trained_gpt2()
    ck = save_checkpoint(tmp_path / "ck", step=2, model=model)
    out = tmp_path / "hf"
    assert (
        main(["export", str(ck), str(out), "--hf", "--hf-model-type", "gpt2", OVERRIDES, "--max-shard-size", "40KB"])
        == 0
    )
    assert json.loads((out / "config.json").read_text())["n_layer"] == 2
    assert (out / "model.safetensors.index.json").is_file()  # several shards
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 61, (3, 10))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    # plain export: the universal layout stores the tied head once (under the embedding's name, as safetensors'
    # save_model does); loading the embedding fills the tied head
    assert main(["export", str(ck), str(tmp_path / "m.safetensors")]) == 0
    plain = transformers.GPT2LMHeadModel(model.config).eval()
    missing, unexpected = plain.load_state_dict(load_file(tmp_path / "m.safetensors"), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    with torch.no_grad():
        assert torch.equal(plain(tokens).logits, model(tokens).logits)


def test_config_json_and_wrong_architecture(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = _trained_gpt2()
    ck = universal_checkpoint(tmp_path / "ck", dict(model.state_dict()), {})
    model.config.save_pretrained(tmp_path / "cfg")
    assert (
        main(["export", str(ck), str(tmp_path / "hf"), "--hf", "--hf-config", str(tmp_path / "cfg/config.json")]) == 0
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 61, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    # a config with other widths: refused naming the shapes, nothing written
    assert (
        main(
            [
                "export",
                str(ck),
                str(tmp_path / "bad"),
                "--hf",
                "--hf-model-type",
                "gpt2",
                "n_layer=2,n_embd=64,n_head=2,vocab_size=61,n_positions=16",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "does not fit GPT2LMHeadModel" in err and "transformer.wte.weight" in err
    assert not (tmp_path / "bad").exists()
