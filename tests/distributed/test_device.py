"""Per-rank GPU selection from LOCAL_RANK, checked on CPU by faking torch.cuda's device functions."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.device import cuda_index_for_rank, select_device
from shardkit.nn.fsdp import param_group
from shardkit.nn.fsdp.policy_types import FSDPPolicies, OffloadPolicy


class FakeCuda:
    """torch.cuda's device functions over ``visible`` pretend GPUs; records every set_device."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, visible: int, current: int = 0) -> None:
        self.visible, self.current, self.set_calls = visible, current, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.visible)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self._set)

    def _set(self, index: int) -> None:
        self.set_calls.append(index)
        self.current = index


def test_rule_follows_local_rank_and_keeps_an_explicit_choice() -> None:
    assert cuda_index_for_rank(3, visible=8, current=0) == 3
    assert cuda_index_for_rank(3, visible=1, current=0) == 0  # CUDA_VISIBLE_DEVICES per rank
    assert cuda_index_for_rank(None, visible=8, current=0) == 0
    assert cuda_index_for_rank(3, visible=8, current=5) == 5  # the script chose: keep it
    with pytest.raises(RuntimeError, match="only 4 GPUs are visible"):
        cuda_index_for_rank(5, visible=4, current=0)


def test_select_device_sets_local_rank_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda(monkeypatch, visible=8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert select_device() == torch.device("cuda", 3)
    assert select_device() == torch.device("cuda", 3)
    assert fake.set_calls == [3]


def test_select_device_without_cuda_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert select_device() == torch.device("cpu")


def test_bad_local_rank_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch, visible=2)
    monkeypatch.setenv("LOCAL_RANK", "two")
    with pytest.raises(ValueError, match="LOCAL_RANK must be an integer"):
        select_device()


def test_fsdp_offload_computes_on_the_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: cuda:current_device(), i.e. cuda:0 on every rank of the node.
    fake = FakeCuda(monkeypatch, visible=4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    owners = [(None, nn.Parameter(torch.zeros(3)))]
    policies = FSDPPolicies(offload=OffloadPolicy(offload_params=True))
    assert param_group._compute_device(owners, policies) == torch.device("cuda", 2)  # type: ignore[arg-type]
    assert fake.set_calls == [2]


def test_smp_execution_device_is_the_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.modelparallel.building import build

    fake = FakeCuda(monkeypatch, visible=4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")
    state = types.SimpleNamespace(distributed=True)
    assert build.execution_device(state, nn.Linear(2, 2)) == torch.device("cuda", 1)  # type: ignore[arg-type]
    assert fake.set_calls == [1]


def test_nccl_object_collectives_select_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.distributed import objects

    calls = []
    monkeypatch.setattr(objects, "select_device", lambda: calls.append("select"))
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")
    objects._on_rank_device(object())  # type: ignore[arg-type]
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "gloo")
    objects._on_rank_device(object())  # type: ignore[arg-type]
    assert calls == ["select"]


def test_object_sends_on_nccl_use_the_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: cuda:current_device() without selecting, i.e. cuda:0 on every rank of the node.
    from shardkit.distributed import object_p2p

    fake = FakeCuda(monkeypatch, visible=4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")
    assert object_p2p._wire_device(object(), None) == torch.device("cuda", 3)  # type: ignore[arg-type]
    assert fake.set_calls == [3]
