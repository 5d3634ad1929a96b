"""The stream discipline of asynchronous activation offload, checked on CPU through a fake device.

On CUDA a saved activation goes to pinned host memory on a side stream and comes back when backward needs it. A
GPU runs those copies later than the host queues them; the fake below does the same on CPU: a copy down lands only
when its event is waited for, and it reads the source only if the source was kept from reuse (``record_stream``),
otherwise it lands NaN, as a reused block would. Reading a host copy before the wait, or letting the source go,
therefore shows up as a wrong gradient, and the tests that drop each step show the fake catches it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from shardkit.nn.checkpoint import checkpoint_wrapper
from shardkit.nn.checkpoint import offload as offload_mod
from shardkit.nn.checkpoint.offload import ActivationOffload, CudaCopies, Offloaded
from shardkit.nn.checkpoint.wrapper import checkpointed_call


class _Stream:
    def __init__(self, name: str) -> None:
        self.name = name


class _Copy:
    """A queued copy down: lands (once) when its event is waited for."""

    def __init__(self, host: torch.Tensor, source: torch.Tensor) -> None:
        self.host, self.source = host, source
        self.kept = False
        self.landed = False


class _FakeDevice(CudaCopies):
    """Every tensor takes the asynchronous path; copies are deferred as a device's are. ``log`` records the order."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.copies: list[_Copy] = []

    def handles(self, tensor: torch.Tensor) -> bool:
        return True

    def current_stream(self, device: torch.device) -> Any:
        return _Stream("compute")

    def side_stream(self, device: torch.device) -> Any:
        self.log.append(("side_stream",))
        return _Stream("side")

    def host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.full(tensor.shape, float("nan"), dtype=tensor.dtype)

    def copy_down(self, stream: Any, after: Any, host: torch.Tensor, tensor: torch.Tensor) -> Any:
        self.log.append(("copy_down", stream.name, "after", after.name))
        pending = _Copy(host, tensor)
        self.copies.append(pending)
        return pending

    def keep_source(self, tensor: torch.Tensor, stream: Any) -> None:
        self.log.append(("keep_source", stream.name))
        for pending in self.copies:
            if pending.source is tensor:
                pending.kept = True

    def wait(self, stream: Any, event: Any) -> None:
        self.log.append(("wait", stream.name))
        if not event.landed:
            event.landed = True
            if event.kept:
                event.host.copy_(event.source)
            event.source = None  # the device is done with it

    def copy_up(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        landed = [c.landed for c in self.copies if c.host is host]
        self.log.append(("copy_up", "landed" if all(landed) else "not landed"))
        return host.to(device, copy=True)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)) * scale)


def _grads(model: nn.Module, offload: ActivationOffload | None, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    x = x.clone().requires_grad_(True)
    scale = torch.full((16,), 0.5)
    if offload is None:
        out = model(x, scale)
    else:
        with offload.hooks():
            out = checkpointed_call(model, model, (x, scale), {})
    (out * out).sum().backward()
    assert x.grad is not None
    return {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


@pytest.fixture
def block_and_input() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Block(), torch.randn(4, 8)


def test_async_offload_matches_no_offload_and_keeps_the_order(block_and_input: Any) -> None:
    model, x = block_and_input
    reference = _grads(copy.deepcopy(model), None, x)
    device = _FakeDevice()
    got = _grads(model, ActivationOffload(pin=False, copies=device), x)
    assert got.keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)
    packed = len(device.copies)
    assert packed >= 2  # the block's inputs x and scale, at least
    # One side stream per forward; each copy down waits for the producing stream, then its source is kept.
    assert device.log[0] == ("side_stream",)
    downs = [e for e in device.log if e[0] in ("copy_down", "keep_source")]
    assert downs == [("copy_down", "side", "after", "compute"), ("keep_source", "side")] * packed
    # Each copy up comes after a wait on the consuming stream, and finds its copy landed.
    ups = [e for e in device.log if e[0] in ("wait", "copy_up")]
    assert ups == [("wait", "compute"), ("copy_up", "landed")] * len(ups[::2])
    assert all(c.landed for c in device.copies)


class _NoWait(ActivationOffload):
    def unpack(self, packed: Offloaded) -> torch.Tensor:
        return self.copies.copy_up(packed.host, packed.device)  # reads the host copy before its copy has landed


class _SourceNotKept(ActivationOffload):
    def pack(self, tensor: torch.Tensor) -> Offloaded:
        host = self.copies.host_buffer(tensor)
        done = self.copies.copy_down(_Stream("side"), self.copies.current_stream(tensor.device), host, tensor)
        return Offloaded(tensor.device, host, done)  # no keep_source: the block may be reused before the copy


@pytest.mark.parametrize("broken", [_NoWait, _SourceNotKept])
def test_the_fake_device_catches_a_missing_wait_or_keep(block_and_input: Any, broken: type) -> None:
    """The check above can fail: leave out the wait or the keep and the gradients come out wrong (NaN)."""
    model, x = block_and_input
    got = _grads(model, broken(pin=False, copies=_FakeDevice()), x)
    assert any(not torch.isfinite(g).all() for g in got.values())


class _Untouchable(CudaCopies):
    def __getattribute__(self, name: str) -> Any:
        if name == "handles":
            return lambda tensor: False  # what CUDA's says of a CPU tensor
        raise AssertionError(f"a CPU tensor reached the device path ({name})")


def test_cpu_tensors_take_the_synchronous_path_without_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offload_mod, "CUDA_COPIES", _Untouchable())
    offload = ActivationOffload(pin=False)
    source = torch.arange(6.0).view(2, 3)
    packed = offload.pack(source)
    assert packed.done is None and packed.host.device.type == "cpu" and not packed.host.is_pinned()
    assert packed.host.data_ptr() != source.data_ptr()  # a copy, as shardkit::to_host makes
    assert torch.equal(offload.unpack(packed), source)
    # The wrapper leaves CPU inputs alone entirely (no hooks at all), with or without a device object.
    torch.manual_seed(0)
    ref = _Block()
    wrapped = checkpoint_wrapper(copy.deepcopy(ref), offload_to_cpu=True)
    x, scale = torch.randn(4, 8), torch.ones(16)
    wrapped(x, scale).sum().backward()
    ref(x, scale).sum().backward()
    for (name, p), q in zip(ref.named_parameters(), wrapped.parameters()):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


def test_one_side_stream_per_device_per_forward(block_and_input: Any) -> None:
    model, x = block_and_input
    device = _FakeDevice()
    offload = ActivationOffload(pin=False, copies=device)
    _grads(model, offload, x)
    _grads(model, offload, x)  # the same hooks object reused: still one stream
    assert device.log.count(("side_stream",)) == 1
