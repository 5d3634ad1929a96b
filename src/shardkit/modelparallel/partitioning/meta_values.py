"""Tracing on the meta device with the inputs' values known: for models built inside
``smp.delay_param_initialization``, whose glue code reads input values (a Hugging Face model checks
``attention_mask.all()`` to choose its causal-mask path).

A delayed model has no parameter values, so rank 0 traces it on the meta device, where tensors have shapes but no
data, and ``.item()`` (any Python ``if`` on a tensor) fails. Under :class:`MetaValues`, every input tensor moved to
meta keeps its real value beside it (a CPU copy), and each operator whose tensor arguments all have one (or that
creates a tensor from nothing, such as ``torch.arange``) is also run on those values: what is computed from the
inputs alone (masks, position ids) stays known, while anything touching a parameter is meta as before. An operator
that cannot run on meta (reading a value) returns the real result when its arguments are known, and raises as
before otherwise. The values are small: they follow the inputs, never the activations.
"""

from __future__ import annotations

from typing import Any

import torch

from shardkit.utils._torch_private import TorchDispatchMode, tree_flatten, tree_map

#: The attribute of a meta tensor holding its real value.
VALUE = "_shardkit_meta_value"
_META = torch.device("meta")


def to_meta_with_values(value: Any) -> Any:
    """``value`` with every tensor moved to the meta device, each keeping a CPU copy of its data (see above)."""

    def move(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.is_meta:
            return x
        meta = x.detach().to(_META).requires_grad_(x.requires_grad)
        setattr(meta, VALUE, x.detach().to("cpu", copy=True))
        return meta

    return tree_map(move, value)


class MetaValues(TorchDispatchMode):
    """Carry real values along meta tensors computed from the inputs alone (see the module docstring)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        metas = [t for t in tensors if t.is_meta]
        known = all(hasattr(t, VALUE) for t in metas) and (bool(metas) or _creates_meta(kwargs, tensors))
        try:
            out = func(*args, **kwargs)
        except Exception:
            if not known:
                raise
            return tree_map(_meta_with_value, _run_real(func, args, kwargs))
        out_leaves, _ = tree_flatten(out)
        if not known:
            # An in-place update from an unknown value (a parameter) leaves its target unknown too.
            for fake in out_leaves:
                if isinstance(fake, torch.Tensor) and hasattr(fake, VALUE):
                    delattr(fake, VALUE)
            return out
        real_leaves, _ = tree_flatten(_run_real(func, args, kwargs))
        for fake, real in zip(out_leaves, real_leaves):
            if isinstance(fake, torch.Tensor) and fake.is_meta and isinstance(real, torch.Tensor):
                setattr(fake, VALUE, real)
        return out


def _creates_meta(kwargs: dict[str, Any], tensors: list[torch.Tensor]) -> bool:
    """A factory operator (no tensor arguments) asked to create a meta tensor."""
    device = kwargs.get("device")
    return not tensors and device is not None and torch.device(device).type == "meta"


def _run_real(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    def real(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_meta:
            return getattr(x, VALUE)
        return x

    real_kwargs = {k: real(v) for k, v in kwargs.items()}
    device = real_kwargs.get("device")
    if device is not None and torch.device(device).type == "meta":
        real_kwargs["device"] = torch.device("cpu")
    return func(*tree_map(real, args), **{k: tree_map(real, v) for k, v in real_kwargs.items()})


def _meta_with_value(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    meta = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_META)
    setattr(meta, VALUE, x)
    return meta
