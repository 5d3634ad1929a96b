"""``shardkit checkpoint import`` of per-rank model-parallel files (Llama's ``consolidated.0N.pth``): the universal
checkpoint loads into the unsplit model with the weights the files were cut from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardkit import tensor_parallel as tp
from shardkit.checkpoint import load_checkpoint
from shardkit.checkpoint.cli import main
from shardkit.checkpoint.errors import CorruptCheckpointError
from shardkit.checkpoint.tools.import_ import import_checkpoint
from shardkit.checkpoint.tools.model_parallel import llama_specs


class _Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


def _block(dim: int, hidden: int) -> nn.Module:
    block = nn.Module()
    block.attention = nn.Module()
    for name in ("wq", "wk", "wv", "wo"):
        setattr(block.attention, name, nn.Linear(dim, dim, bias=False))
    block.feed_forward = nn.Module()
    block.feed_forward.w1 = nn.Linear(dim, hidden, bias=False)
    block.feed_forward.w2 = nn.Linear(hidden, dim, bias=False)
    block.feed_forward.w3 = nn.Linear(dim, hidden, bias=False)
    block.attention_norm, block.ffn_norm = _Norm(dim), _Norm(dim)
    return block


def _llama_named(seed: int) -> nn.Module:
    """The unsplit model with Llama's parameter names (plain layers)."""
    torch.manual_seed(seed)
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(12, 8)
    model.layers = nn.ModuleList([_block(8, 16) for _ in range(2)])
    model.norm = _Norm(8)
    model.output = nn.Linear(8, 12, bias=False)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    return model


def _write(state: dict[str, torch.Tensor], folder: Path, degree: int) -> None:
    tp.save_shard_files(folder, tp.split_state_dict(state, llama_specs(list(state)), degree))


@pytest.mark.parametrize("degree", [2, 4])
def test_llama_shard_files_import_into_the_unsplit_model(tmp_path: Path, degree: int) -> None:
    want = _llama_named(seed=0).state_dict()
    _write(want, tmp_path / "llama", degree)
    assert main(["import", str(tmp_path / "llama"), str(tmp_path / "ck"), "--step", "3"]) == 0  # format detected
    model = _llama_named(seed=1)
    assert load_checkpoint(tmp_path / "ck", model=model).step == 3
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_any_model_imports_with_its_own_layout(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
    specs = {"0.weight": tp.ShardSpec(0, stride=3), "0.bias": tp.ShardSpec(0, stride=3), "2.weight": tp.ShardSpec(1)}
    tp.save_shard_files(tmp_path / "mp", tp.split_state_dict(model.state_dict(), specs, 2))
    import_checkpoint(tmp_path / "mp", tmp_path / "ck", shard_specs=specs)
    fresh = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
    load_checkpoint(tmp_path / "ck", model=fresh)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_missing_ranks_and_mixed_checkpoints_are_refused(tmp_path: Path) -> None:
    state = _llama_named(seed=0).state_dict()
    _write(state, tmp_path / "gap", 4)
    (tmp_path / "gap" / "consolidated.02.pth").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"ranks \[0, 1, 3\]; 0..N-1 are needed"):
        import_checkpoint(tmp_path / "gap", tmp_path / "ck1")
    _write(state, tmp_path / "mixed", 2)
    other = {k: v + 1 for k, v in state.items()}
    torch.save(tp.split_state_dict(other, llama_specs(list(other)), 2)[1], tmp_path / "mixed" / "consolidated.01.pth")
    with pytest.raises(CorruptCheckpointError, match=r"'layers\.0\.attention_norm\.weight' differs between"):
        import_checkpoint(tmp_path / "mixed", tmp_path / "ck2")
    assert not (tmp_path / "ck1").exists() and not (tmp_path / "ck2").exists()
