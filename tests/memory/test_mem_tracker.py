"""shardkit.memory.MemoryTracker: exact byte counts by category, frees and resizes, peak, per module, tags."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.memory import Category, MemoryTracker, tag
from shardkit.testing import models as M


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_training_step_counts_parameters_gradients_and_adam_state_exactly() -> None:
    with MemoryTracker() as tracker:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        tracker.watch(model, optim)
        before = tracker.current
        x = torch.randn(64, 16)
        model(x).square().mean().backward()
        optim.step()
        after = tracker.current
    nbytes = _param_bytes(model)
    n_params = len(list(model.parameters()))
    assert before[Category.PARAMETERS] == nbytes and before[Category.GRADIENTS] == 0
    assert after[Category.PARAMETERS] == nbytes
    assert after[Category.GRADIENTS] == nbytes
    # Adam: exp_avg and exp_avg_sq per parameter, plus a float32 scalar step counter each.
    assert after[Category.OPTIMIZER_STATE] == 2 * nbytes + 4 * n_params
    assert after[Category.ACTIVATIONS] == 0  # every activation was freed by backward
    peak = tracker.peak
    assert peak.total >= after.total
    # Each module leaves its output behind; while the last Linear runs, the input, the ReLU's output (the first
    # Linear's output is gone once Sequential moves on) and its own output are alive.
    assert tracker.modules["0"].retained == 64 * 32 * 4
    assert tracker.modules["2"].forward_peak == before.total + (64 * 16 + 64 * 32 + 64 * 8) * 4


def test_frees_resizes_and_peak() -> None:
    with MemoryTracker() as tracker:
        base = tracker.current.total
        a = torch.empty(1000)  # 4000 bytes, created outside any forward: a temporary
        assert tracker.current[Category.TEMPORARIES] - 0 >= 4000
        assert tracker.current.total == base + 4000
        a.untyped_storage().resize_(0)  # how FSDP frees full parameters: outside any operator
        assert tracker.current.total == base
        a.untyped_storage().resize_(8000)
        assert tracker.current.total == base + 8000
        view = a[:10]
        del a
        assert tracker.current.total == base + 8000  # a view keeps the storage alive, counted once
        del view
        assert tracker.current.total == base
        assert tracker.peak.total == base + 8000
        tracker.reset_peak()
        assert tracker.peak.total == base
    assert not hasattr(torch.UntypedStorage.resize_, "_shardkit_memory_tracker")  # method restored on exit


def test_tag_relabels_and_is_free_without_a_tracker() -> None:
    loose = torch.ones(10)
    tag(loose, Category.PARAMETERS)  # no tracker: nothing happens, nothing raises
    with MemoryTracker() as tracker:
        t = torch.zeros(256)
        tag(t, Category.GRADIENTS)
        assert tracker.current[Category.GRADIENTS] == 1024
        assert tracker.current[Category.TEMPORARIES] == 0


def test_activations_inside_forward_and_module_names() -> None:
    with MemoryTracker() as tracker:
        model = M.TransformerLM(M.LMConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=2, seq_len=8))
        tracker.watch(model)
        tokens = torch.randint(0, 32, (2, 8))
        logits = model(tokens)
        mid = tracker.current
        assert mid[Category.ACTIVATIONS] >= logits.numel() * 4
        assert {"blocks.0", "blocks.1", "head"} <= set(tracker.modules)
        logits.sum().backward()
        done = tracker.current
    assert done[Category.ACTIVATIONS] < mid[Category.ACTIVATIONS]
    assert done[Category.GRADIENTS] == _param_bytes(model)


def test_only_one_tracker_at_a_time() -> None:
    with MemoryTracker(), pytest.raises(RuntimeError, match="one at a time"), MemoryTracker():
        pass
