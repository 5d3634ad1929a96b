"""What ``smp.save_checkpoint(user_content=...)`` may hold, in a form weights-only loading accepts.

Checkpoints are read back weights-only (no pickled code runs), which refuses arbitrary classes. Scripts store two
kinds of objects there that are only data: Hugging Face configs (``GPT2Config``) and NumPy scalars
(``np.prod(shape)`` gives a ``numpy.int64``). Before saving, :func:`encode` turns each config into a tagged dict of
its ``to_dict()`` and each NumPy scalar into the Python number it holds (``numpy.int64(3)`` -> ``3``); NumPy arrays
become tagged tensors. On resume, :func:`decode` turns tagged configs back into their class (looked up by name in
``transformers``, which must be importable and must name a ``PretrainedConfig`` subclass, else the tagged dict is
returned as is) and tagged arrays back into arrays. Anything else that weights-only loading refuses is refused
at save time, naming it.
"""

from __future__ import annotations

import importlib
import warnings
from collections import OrderedDict
from typing import Any

import torch

#: Key marking an encoded object inside the saved user content.
TAG = "__shardkit_user_content__"


def encode(value: Any) -> Any:
    """``value`` with configs, NumPy scalars and arrays replaced as the module docstring says (containers are
    rebuilt, other leaves kept)."""
    if isinstance(value, dict):
        return _same_kind(value, {k: encode(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        items = [encode(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    numpy = _numpy()
    if numpy is not None:
        if isinstance(value, numpy.generic):
            return value.item()
        if isinstance(value, numpy.ndarray):
            return {TAG: "numpy.ndarray", "value": torch.from_numpy(numpy.ascontiguousarray(value)).clone()}
    if _is_hf_config(value):
        return {TAG: "transformers_config", "class": type(value).__name__, "value": encode(value.to_dict())}
    return value


def decode(value: Any) -> Any:
    """Undo :func:`encode` on loaded user content."""
    if isinstance(value, dict):
        kind = value.get(TAG)
        if kind == "transformers_config":
            return _config(value)
        if kind == "numpy.ndarray":
            return value["value"].numpy()
        return _same_kind(value, {k: decode(v) for k, v in value.items()})
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(decode(v) for v in value)
    return value


def _same_kind(original: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """``items`` as an ``OrderedDict`` when ``original`` is one (weights-only loading keeps those), else a dict."""
    return OrderedDict(items) if isinstance(original, OrderedDict) else items


def _config(tagged: dict[str, Any]) -> Any:
    name = tagged.get("class")
    try:
        transformers = importlib.import_module("transformers")
        cls = getattr(transformers, str(name))
        base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    except (ImportError, AttributeError):
        warnings.warn(
            f"smp.resume_from_checkpoint: user_content holds a transformers {name} that cannot be rebuilt here "
            "(transformers is not installed or has no such class); it is returned as its tagged dict",
            stacklevel=3,
        )
        return tagged
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"user_content names transformers.{name} as a config class, which it is not")
    return cls.from_dict(decode(tagged["value"]))  # type: ignore[attr-defined]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return None
    return numpy


#: transformers' config base class (renamed from ``PretrainedConfig`` to ``PreTrainedConfig`` in v5).
_CONFIG_BASES = ("PretrainedConfig", "PreTrainedConfig")


def _is_hf_config(value: Any) -> bool:
    for cls in type(value).__mro__:
        if cls.__name__ in _CONFIG_BASES and cls.__module__.startswith("transformers."):
            return True
    return False
