"""checkpoint_wrapper: gradient parity with the plain module, RNG replay, BatchNorm statistics, kwargs, eval."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardkit.nn import checkpoint_wrapper
from shardkit.nn.checkpoint import CheckpointWrapper


class CountingMLP(nn.Module):
    """Linear → Dropout → GELU → Linear; counts its forward calls."""

    def __init__(self, width: int = 16, p: float = 0.5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(4 * width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc2(F.gelu(self.drop(self.fc1(x))))


class BNBlock(nn.Module):
    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16, momentum=momentum)
        self.inorm = nn.InstanceNorm1d(16, track_running_stats=True)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.fc(x))))
        return self.inorm(h.unsqueeze(1).expand(-1, 16, -1)).mean(1)


class KwargsBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, tag: str, mask: torch.Tensor | None = None) -> dict:
        y = self.fc(x) * scale
        if mask is not None:
            y = y.masked_fill(mask, 0.0)
        return {"y": y, "tag": tag.upper(), "count": 3, "nothing": None, "pair": (y.sum(), "s")}


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _step(module: nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    out = module(x)
    # Advance the RNG between forward and backward: a recomputation that did not replay the RNG state
    # would draw a different dropout mask and produce different gradients.
    torch.rand(1000)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach()


def test_dropout_gradients_match_and_forward_is_recomputed() -> None:
    ref = CountingMLP()
    wrapped = checkpoint_wrapper(copy.deepcopy(ref))
    x = torch.randn(4, 16)
    out_ref = _step(ref, x, seed=7)
    out = _step(wrapped, x, seed=7)
    assert wrapped.calls == 2 and ref.calls == 1  # the backward re-ran the forward
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    for name, grad in _grads(ref).items():
        torch.testing.assert_close(_grads(wrapped)[name], grad, rtol=0, atol=0)


def test_input_gradient_flows_through_checkpoint() -> None:
    ref = CountingMLP(p=0.0)
    wrapped = checkpoint_wrapper(copy.deepcopy(ref))
    x_ref = torch.randn(3, 16, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    ref(x_ref).pow(2).sum().backward()
    wrapped(x).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_statistics_updated_once(momentum: float | None) -> None:
    ref = BNBlock(momentum)
    wrapped = checkpoint_wrapper(copy.deepcopy(ref))
    for step in range(2):
        x = torch.randn(6, 8)
        _step(ref, x, seed=step)
        _step(wrapped, x, seed=step)
    ref_state, state = ref.state_dict(), wrapped.state_dict()
    assert int(state["bn.num_batches_tracked"]) == 2
    for key in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "inorm.running_mean"):
        torch.testing.assert_close(state[key], ref_state[key], rtol=0, atol=0)
    for name, grad in _grads(ref).items():
        torch.testing.assert_close(_grads(wrapped)[name], grad)


def test_kwargs_and_non_tensor_outputs() -> None:
    ref = KwargsBlock()
    wrapped = checkpoint_wrapper(copy.deepcopy(ref))
    x = torch.randn(4, 8)
    mask = torch.rand(4, 8) > 0.7
    scale_ref = torch.tensor(1.5, requires_grad=True)
    scale = scale_ref.detach().clone().requires_grad_()
    out_ref = ref(x, scale=scale_ref, tag="ab", mask=mask)
    out = wrapped(x, scale=scale, tag="ab", mask=mask)
    assert (out["tag"], out["count"], out["nothing"], out["pair"][1]) == ("AB", 3, None, "s")
    (out_ref["y"].pow(2).sum() + out_ref["pair"][0]).backward()
    (out["y"].pow(2).sum() + out["pair"][0]).backward()
    torch.testing.assert_close(scale.grad, scale_ref.grad)
    torch.testing.assert_close(wrapped.fc.weight.grad, ref.fc.weight.grad)


def test_eval_and_no_grad_run_a_plain_forward() -> None:
    wrapped = checkpoint_wrapper(CountingMLP())
    x = torch.randn(2, 16)
    wrapped.eval()
    expected = wrapped.wrapped_module(x)
    wrapped.wrapped_module.calls = 0  # attribute reads are forwarded, writes are not
    out = wrapped(x)
    out.sum().backward()
    assert wrapped.calls == 1
    torch.testing.assert_close(out, expected)
    wrapped.train()
    with torch.no_grad():
        assert not wrapped(x).requires_grad
    assert wrapped.calls == 2


def test_state_dict_keys_match_the_unwrapped_module() -> None:
    plain = nn.Sequential(nn.Linear(8, 16), BNBlock(), nn.Linear(4, 2))
    model = copy.deepcopy(plain)
    model[1] = checkpoint_wrapper(model[1])
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model[1].named_parameters()] == [n for n, _ in plain[1].named_parameters()]
    assert [n for n, _ in model[1].named_buffers()] == [n for n, _ in plain[1].named_buffers()]
    assert list(model[1].state_dict()) == list(plain[1].state_dict())
    # The module version metadata travels under the unwrapped names too.
    assert model.state_dict()._metadata["1.bn"] == plain.state_dict()._metadata["1.bn"]

    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    model.load_state_dict(plain.state_dict())
    for (name, p), q in zip(plain.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(q, p, msg=name)
    plain.load_state_dict(model.state_dict())  # and back

    bad = plain.state_dict()
    del bad["1.fc.weight"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "1\.fc\.weight"'):
        model.load_state_dict(bad)


def test_attribute_access_copy_and_pickle() -> None:
    wrapped = checkpoint_wrapper(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert isinstance(wrapped[0], nn.Linear)
    block = checkpoint_wrapper(CountingMLP())
    assert block.fc1.out_features == 64
    clone = pickle.loads(pickle.dumps(block))
    assert isinstance(clone, CheckpointWrapper)
    assert list(clone.state_dict()) == list(block.state_dict())
    assert list(copy.deepcopy(block).state_dict()) == list(block.state_dict())


def test_bad_input_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        checkpoint_wrapper(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_wrapper(checkpoint_wrapper(nn.Linear(2, 2)))


def test_offload_to_cpu_on_cpu_inputs_changes_nothing() -> None:
    ref = CountingMLP()
    wrapped = checkpoint_wrapper(copy.deepcopy(ref), offload_to_cpu=True)
    x = torch.randn(4, 16)
    torch.testing.assert_close(_step(wrapped, x, seed=3), _step(ref, x, seed=3))
    for name, grad in _grads(ref).items():
        torch.testing.assert_close(_grads(wrapped)[name], grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading from an accelerator needs CUDA")
def test_offload_to_cpu_keeps_saved_inputs_on_host() -> None:
    device = torch.device("cuda")
    wrapped = checkpoint_wrapper(CountingMLP().to(device), offload_to_cpu=True)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    devices = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        devices.append(t.device.type)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = wrapped(x)
    assert devices == []  # save_on_cpu, not our outer hook, saw the input
    out.sum().backward()
    assert x.grad is not None and x.grad.device.type == "cuda"
