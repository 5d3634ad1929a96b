"""Comparisons of models, state dicts and optimizer states, returning a number or a message for the assertion."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest element-wise gap between the parameters of two models of one architecture, in order."""
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def max_state_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest element-wise gap between two state dicts with the same keys (compared in float32)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def state_difference(
    expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6
) -> Optional[str]:
    """None when ``got`` has ``expected``'s keys, shapes and values (within ``rtol``/``atol``: fp32
    reduction-order differences by default), else what differs first."""
    if sorted(expected) != sorted(got):
        return f"keys differ: {sorted(set(expected) ^ set(got))}"
    for key, want in expected.items():
        have = got[key]
        if have.shape != want.shape:
            return f"{key}: shapes {tuple(have.shape)} and {tuple(want.shape)}"
        if not torch.allclose(have, want, rtol=rtol, atol=atol):
            return f"{key}: max difference {(have - want).abs().max().item()}"
    return None


def bitwise_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> Optional[str]:
    """The first key whose tensors differ in any bit or dtype (or that only one side has), else ``None``."""
    if list(a) != list(b):
        return f"keys differ: {sorted(set(a) ^ set(b))}"
    for key in a:
        if a[key].dtype != b[key].dtype or not torch.equal(a[key], b[key]):
            return f"{key}: max diff {(a[key].double() - b[key].double()).abs().max().item()}"
    return None


def assert_states_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], **tol: Any) -> None:
    """``torch.testing.assert_close`` key by key (``tol``: its ``atol``/``rtol``), after checking the keys."""
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, msg=key, **tol)


def same_optimizer_state(a: dict[str, Any], b: dict[str, Any], atol: float = 1e-6) -> bool:
    """Two ``torch.optim`` state dicts hold the same param groups and (to ``atol``) the same state tensors."""
    if a["param_groups"] != b["param_groups"] or sorted(a["state"]) != sorted(b["state"]):
        return False
    for pid, state in a["state"].items():
        other = b["state"][pid]
        if sorted(state) != sorted(other):
            return False
        if not all(torch.allclose(state[k].cpu(), other[k].cpu(), atol=atol) for k in state):
            return False
    return True
