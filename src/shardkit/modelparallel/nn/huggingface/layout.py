"""The translation shared by the ``smp.nn.huggingface`` families whose modules map one to one onto smp's (GPT-J,
GPT-Neo, BERT, RoBERTa): a table per family says which Hugging Face module inside layer ``i`` becomes which smp module
inside ``seq_layers.i``, which keys outside the layers are renamed, which are dropped (a tied head, buffers the
model rebuilds) and whether the others are kept as they are. Weights keep their orientation (these families use
``nn.Linear``, as smp does); GPT-2's fused, transposed ``Conv1D`` has its own module (:mod:`.gpt2`).

Every key is accounted for: one the table does not know raises ``KeyError`` (never silently dropped), and going
back, a layer's key that has no Hugging Face name raises too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class Layout:
    """One family's correspondence between Hugging Face's state-dict keys and smp's.

    Attributes:
        family: the name in errors.
        hf_layers, smp_layers: the layer lists' paths (``"encoder.layer"``, ``"encoder.seq_layers"``); keys match
            after any outer prefix (``"bert."``), which is kept.
        block: Hugging Face module inside a layer -> smp module inside the same layer.
        top: Hugging Face key outside the layers -> smp key.
        tied: Hugging Face key dropped going to smp -> the Hugging Face key whose tensor it gets back (a tied head).
        dropped: keys (regular expression, searched) of buffers dropped going to smp (the model rebuilds them).
        keep_others: keep every other key outside the layers as it is (the modules smp leaves to Hugging Face);
            otherwise an unknown key raises.
    """

    family: str
    hf_layers: str
    smp_layers: str
    block: Mapping[str, str]
    top: Mapping[str, str] = field(default_factory=dict)
    tied: Mapping[str, str] = field(default_factory=dict)
    dropped: str = r"$^"
    keep_others: bool = False

    def _layer_key(self, layers: str) -> re.Pattern[str]:
        return re.compile(rf"^(.*?){re.escape(layers)}\.(\d+)\.(.+)\.(weight|bias)$")

    def to_smp(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state_dict`` (Hugging Face keys) under smp's keys."""
        layer_key, dropped = self._layer_key(self.hf_layers), re.compile(self.dropped)
        out: dict[str, torch.Tensor] = {}
        unknown = []
        for key, value in state_dict.items():
            match = layer_key.match(key)
            if match is not None and match.group(3) in self.block:
                outer, index, module, kind = match.groups()
                out[f"{outer}{self.smp_layers}.{index}.{self.block[module]}.{kind}"] = value
            elif key in self.top:
                out[self.top[key]] = value
            elif key in self.tied or dropped.search(key):
                continue
            elif match is None and self.keep_others:
                out[key] = value
            else:
                unknown.append(key)
        refuse_unknown(unknown, f"Hugging Face {self.family}")
        return out

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state_dict`` (smp's keys) under Hugging Face's, the tied keys set from their source."""
        layer_key, block, top = self._layer_key(self.smp_layers), _inverse(self.block), _inverse(self.top)
        out: dict[str, torch.Tensor] = {}
        unknown = []
        for key, value in state_dict.items():
            match = layer_key.match(key)
            if match is not None and match.group(3) in block:
                outer, index, module, kind = match.groups()
                out[f"{outer}{self.hf_layers}.{index}.{block[module]}.{kind}"] = value
            elif key in top:
                out[top[key]] = value
            elif match is None and self.keep_others:
                out[key] = value
            else:
                unknown.append(key)
        refuse_unknown(unknown, f"smp {self.family}")
        for key, source in self.tied.items():
            if source in out:
                out[key] = out[source]
        return out


def _inverse(mapping: Mapping[str, str]) -> dict[str, str]:
    return {value: key for key, value in mapping.items()}


def check_positions(state_dict: Mapping[str, torch.Tensor], key: str, max_seq_len: Optional[int]) -> None:
    """Refuse a ``max_seq_len`` that is not a positive int, or exceeds the rows of the position table ``key``."""
    if max_seq_len is None:
        return
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    rows = state_dict[key].shape[0] if key in state_dict else None
    if rows is not None and max_seq_len > rows:
        raise ValueError(f"max_seq_len={max_seq_len} exceeds the {rows} positions of {key!r}")


def refuse_unknown(keys: list[str], what: str) -> None:
    """Raise ``KeyError`` naming (the first few of) ``keys``, which are not part of a ``what`` state dict."""
    if keys:
        raise KeyError(
            f"not part of a {what} state dict: {', '.join(map(repr, keys[:5]))}{'...' if len(keys) > 5 else ''}"
        )
