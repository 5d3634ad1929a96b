"""An asynchronous save's staged host copies are complete before ``stage`` hands them to the writer.

On CUDA the copies are asynchronous (pinned memory, ``non_blocking``) and the background writer reads them at
once. CPU cannot run that copy, so a fake device copier stands in: its copies land only when ``wait`` is called,
as a CUDA copy lands only when its stream reaches it. A stage that forgets to wait hands zeros to the writer.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import pytest
import torch

from shardkit.checkpoint.universal import save as universal_save
from shardkit.checkpoint.universal.source import Held, Span, UniversalSource


class _Plain(UniversalSource):
    strategy = "plain"

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def held(self) -> list[Held]:
        return [Held(t, (Span(n, t.shape, 0, t.numel()),)) for n, t in self.tensors.items()]

    def local_optimizer(self) -> Optional[torch.optim.Optimizer]:
        return None


class _DeferredCopies:
    """Like a device's asynchronous copies: each result is garbage until ``wait``; counts the waits."""

    made: ClassVar[list[_DeferredCopies]] = []

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.waits = 0
        _DeferredCopies.made.append(self)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        out = torch.full(tensor.shape, float("nan"), dtype=tensor.dtype)
        self.pending.append((out, tensor.detach().clone()))
        return out

    def wait(self) -> None:
        self.waits += 1
        for out, src in self.pending:
            out.copy_(src)
        self.pending.clear()


def test_stage_waits_for_device_copies_before_returning(monkeypatch: pytest.MonkeyPatch) -> None:
    _DeferredCopies.made.clear()
    monkeypatch.setattr(universal_save, "HostCopies", _DeferredCopies)
    live = {"w": torch.arange(6.0).view(2, 3), "b": torch.tensor([7.0, 8.0])}
    staged = universal_save.stage(_Plain(live), copy=True)
    assert [c.waits for c in _DeferredCopies.made] == [1]
    got = {p.key: p.tensor for p in staged.pieces}
    assert torch.equal(got["model/w"], live["w"]) and torch.equal(got["model/b"], live["b"])
    live["w"].add_(100.0)  # training moves on; the staged copy keeps the state at the call
    assert torch.equal(got["model/w"], torch.arange(6.0).view(2, 3))


def test_host_copies_on_cpu_are_private_copies() -> None:
    copies = universal_save.HostCopies()
    src = torch.arange(4.0)[::2]
    out = copies.copy(src)
    copies.wait()
    src.zero_()
    assert torch.equal(out, torch.tensor([0.0, 2.0])) and out.device.type == "cpu"
