"""Resolve a plan against one model and a degree, changing nothing: which module gets which style, which attention
attributes change to what, how the vocabulary is treated, and what stays whole.

Pure arithmetic on the model's modules and config, so every rank computes the same answer and, for a degree that
does not divide a size, raises the same ``ValueError`` (naming every offending module, its size, and the degrees
that would divide all of them) before anything is changed.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Optional

from torch import nn
from torch.distributed.tensor import DTensor

from shardkit.tensor_parallel.hf.plans import HFPlan, hf_plan_for
from shardkit.tensor_parallel.hf.problem import Problem, is_exactly, is_hf_conv1d
from shardkit.tensor_parallel.hf.vocab import VocabDecision, decide_vocab
from shardkit.tensor_parallel.layout import divisors
from shardkit.tensor_parallel.sharding import TensorParallelModule


@dataclass(frozen=True)
class ResolvedHFPlan:
    """What :func:`~shardkit.tensor_parallel.hf.parallelize_hf` will do to one model at one degree.

    Attributes:
        plan: the family plan used.
        tp_size: the tensor-parallel degree.
        layers: ``(module path, style)`` for every module the plan splits, model-relative paths.
        head_updates: ``(attention module path, attribute, value on each rank)``.
        vocab: how the input embedding and the output layer are treated.
        unsplit: modules holding parameters that stay whole on every rank, grouped (``h.*.ln_1``) with counts.
        dropout_regions: ``(attention module path, its children acting on the replicated output)``.
        grad_sums: modules left whole whose parameters' gradients are summed over the ranks (they act on split
            activations).
    """

    plan: HFPlan
    tp_size: int
    layers: tuple[tuple[str, str], ...]
    head_updates: tuple[tuple[str, str, int], ...]
    vocab: VocabDecision
    unsplit: tuple[tuple[str, int], ...]
    dropout_regions: tuple[tuple[str, tuple[str, ...]], ...] = ()
    grad_sums: tuple[str, ...] = ()

    def describe_unsplit(self) -> str:
        """``h.*.ln_1 (x2), wpe, ...``: the modules left whole, one line."""
        return ", ".join(f"{name} (x{count})" if count > 1 else name for name, count in self.unsplit) or "none"


def _matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatchcase(n, p) for p, n in zip(parts, names))


def _base_prefix(model: nn.Module) -> tuple[nn.Module, str]:
    base = getattr(model, "base_model", model)
    for name, module in model.named_modules():
        if module is base:
            return base, name
    return model, ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _split_size(path: str, module: nn.Module, style: str) -> Problem:
    """The size ``style`` divides by the degree (``Problem.size``), or a problem without a size when ``module`` is
    not the kind of module the style splits."""
    weight = getattr(module, "weight", None)
    if style == "embedding_rowwise":
        if not is_exactly(module, nn.Embedding):
            return Problem(path, f"is {type(module).__name__}, not nn.Embedding (style {style})")
        return Problem(path, "num_embeddings", module.num_embeddings)
    if style.startswith("conv1d"):
        if weight is None or not is_hf_conv1d(module):
            return Problem(path, f"is {type(module).__name__}, not HF Conv1D (style {style})")
        in_features, out_features = weight.shape
    elif is_exactly(module, nn.Linear):
        in_features, out_features = module.in_features, module.out_features
    else:
        return Problem(path, f"is {type(module).__name__}, not nn.Linear (style {style})")
    if style == "conv1d_fused_qkv":
        if out_features % 3:
            return Problem(path, f"fused q|k|v output features ({out_features}) are not a multiple of 3")
        return Problem(path, "features per q/k/v", out_features // 3)
    if "rowwise" in style:
        return Problem(path, "in_features", in_features)
    return Problem(path, "out_features", out_features)


def _pattern(name: str) -> str:
    """``h.0.attn`` -> ``h.*.attn``: one name for the same module in every layer."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def _group(names: list[str]) -> tuple[tuple[str, int], ...]:
    return tuple(Counter(_pattern(name) for name in names).items())


def _config_heads(config: object, where: str) -> list[Problem]:
    counts = [(a, getattr(config, a, None)) for a in ("num_attention_heads", "num_key_value_heads")]
    return [Problem(where, f"config.{attribute}", heads) for attribute, heads in counts if isinstance(heads, int)]


def _refuse_split_model(model: nn.Module) -> None:
    """A model split already (by this function, or by transformers' own ``tp_plan`` into ``DTensor``s) would be
    split again: its head counts divided twice. Refuse it."""
    layer = next((name for name, m in model.named_modules() if isinstance(m, TensorParallelModule)), None)
    if layer is not None:
        raise ValueError(
            f"parallelize_hf: '{layer}' is a tensor-parallel layer already: this model was split before. Split a "
            "model once, from its unsplit form. Nothing was changed."
        )
    dtensor = next((name for name, p in model.named_parameters() if isinstance(p, DTensor)), None)
    if dtensor is not None:
        raise ValueError(
            f"parallelize_hf: parameter '{dtensor}' is a DTensor: the model is split already (from_pretrained(..., "
            "tp_plan=...) or torch's parallelize_module). Load it without tp_plan and split it here, or use one of "
            "the two. Nothing was changed."
        )


@dataclass(frozen=True)
class _Found:
    """What resolution collects: sizes to check, head-count updates, dropout regions."""

    sizes: list[Problem]
    heads: list[tuple[str, str, int]]
    regions: list[tuple[str, tuple[str, ...]]]


def _attention_entries(plan: HFPlan, name: str, path: str, module: nn.Module, tp_size: int, found: _Found) -> None:
    """Collect the head-count attributes and the dropout region of ``module`` if the plan names it."""
    for pattern, attributes in plan.head_attributes.items():
        if not _matches(pattern, name):
            continue
        for attribute in attributes:
            value = getattr(module, attribute, None)
            if not isinstance(value, int):
                found.sizes.append(Problem(path, f"has no integer attribute '{attribute}' (plan {plan.family})"))
            else:
                found.sizes.append(Problem(path, attribute, value))
                found.heads.append((path, attribute, value // tp_size))
    for pattern, replicated in plan.dropout_regions.items():
        if _matches(pattern, name):
            missing = [child for child in replicated if not hasattr(module, child)]
            found.sizes.extend([Problem(path, f"has no child '{child}' (plan {plan.family})") for child in missing])
            found.regions.append((path, replicated))


def resolve_hf_plan(
    model: nn.Module, tp_size: int, plan: Optional[HFPlan] = None, split_vocab: Optional[bool] = None
) -> ResolvedHFPlan:
    """Work out what splitting ``model`` ``tp_size`` ways does, changing nothing (see :class:`ResolvedHFPlan`).

    ``plan`` defaults to :func:`hf_plan_for` of the model's config; ``split_vocab`` as in ``parallelize_hf``.
    Raises ``ValueError`` listing every module whose size ``tp_size`` does not divide, with the degrees that would.
    """
    _refuse_split_model(model)
    config = getattr(model, "config", None)
    plan = plan if plan is not None else hf_plan_for(config)
    base, prefix = _base_prefix(model)
    vocab = decide_vocab(model, tp_size, split_vocab)
    layers: list[tuple[str, str]] = []
    heads: list[tuple[str, str, int]] = []
    regions: list[tuple[str, tuple[str, ...]]] = []
    grad_sums: list[str] = []
    sizes = list(vocab.sizes)
    for name, module in base.named_modules():
        path = _join(prefix, name)
        style = next((s for p, s in plan.layers.items() if _matches(p, name)), None)
        if style == "replicated_with_grad_allreduce":
            grad_sums.append(path)
        elif style is not None and path not in vocab.handled:
            layers.append((path, style))
            sizes.append(_split_size(path, module, style))
        _attention_entries(plan, name, path, module, tp_size, _Found(sizes, heads, regions))
    if layers:
        attention = next((p for p, s in layers if s in ("colwise", "conv1d_fused_qkv")), layers[0][0])
        sizes += _config_heads(config, attention.rsplit(".", 1)[0])
    else:
        sizes.append(Problem(prefix or type(model).__name__, f"no module matches the {plan.family} plan"))
    problems = [p for p in sizes if p.size is None or p.size % tp_size]
    if problems:
        raise ValueError(_message(plan, tp_size, problems, [p.size for p in sizes if p.size is not None]))
    split_paths = {p for p, _ in layers} | set(vocab.split_modules)
    unsplit = [
        name
        for name, module in model.named_modules()
        if name not in split_paths and any(True for _ in module.parameters(recurse=False))
    ]
    return ResolvedHFPlan(
        plan, tp_size, tuple(layers), tuple(heads), vocab, _group(unsplit), tuple(regions), tuple(grad_sums)
    )


def _message(plan: HFPlan, tp_size: int, problems: list[Problem], sizes: list[int]) -> str:
    fitting = [d for d in divisors(min(sizes)) if all(s % d == 0 for s in sizes)] if sizes else []
    unique = list(dict.fromkeys(Problem(_pattern(p.path), p.what, p.size) for p in problems))
    listed = "; ".join(p.describe() for p in unique[:8])
    more = f" (and {len(unique) - 8} more)" if len(unique) > 8 else ""
    advice = (
        f"tensor-parallel degrees that divide every size the plan splits: {fitting}"
        if any(p.size is not None for p in problems)
        else "the plan does not fit this model"
    )
    return (
        f"parallelize_hf: cannot split this {plan.family} model {tp_size} ways: {listed}{more}. {advice}. "
        "Nothing was changed."
    )
