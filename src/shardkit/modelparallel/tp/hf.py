"""Hugging Face models inside ``smp.tensor_parallelism()``: split whole by the core's family plans, as smp v1 did for
GPT-2, GPT-J, GPT-Neo, BERT and RoBERTa.

A marked ``transformers`` ``PreTrainedModel`` whose family has a plan (see :mod:`shardkit.tensor_parallel.hf`) is
split in place by :func:`~shardkit.tensor_parallel.hf.parallelize_hf` over smp's tensor-parallel group, instead of
module by module. A model built inside ``smp.tensor_parallelism()`` / ``smp.model_creation(tensor_parallelism=True)``
is not marked itself (only the modules created inside it are), so a model counts as marked when it is, or when every
child holding parameters is.

The core's split layers expect the same batch on every rank of a tensor-parallel group: that is smp's
``prescaled_batch: True`` (what AWS's GPT scripts set). Every parameter of a split model then has, on each
tensor-parallel rank, the gradient of the one shared batch, so all of them are averaged over the reduced-data-parallel
group (see :func:`split_model_parameter_ids`). What is not built yet is refused on every rank before anything
changes: ``prescaled_batch: False`` (each rank its own batch), a pipeline (rank 0 traces the model alone to
partition it, and the split layers' collectives need their group), and delayed parameter initialisation.
"""

from __future__ import annotations

import weakref
from typing import Optional

from torch import nn

from shardkit.modelparallel.state import SMPState
from shardkit.modelparallel.tp.registry import Mark, mark_of
from shardkit.tensor_parallel.hf import parallelize_hf, resolve_hf_plan

#: The models split by :func:`split_model` (weak: a dropped model takes its entry).
_SPLIT: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` ``PreTrainedModel`` (False when transformers is not installed)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is an optional dependency
        return False
    return isinstance(module, PreTrainedModel)


def hf_marked(module: nn.Module, inherited: Mark) -> bool:
    """Whether the Hugging Face model ``module`` is marked: by its own or an inherited mark, else (created inside a
    marking context, which marks only what is created in it) when every child holding parameters is marked."""
    own = mark_of(module)
    if own is not None or inherited.enabled:
        return (own or inherited).enabled
    holders = [child for child in module.children() if next(child.parameters(), None) is not None]
    return bool(holders) and all((mark_of(child) or Mark(False)).enabled for child in holders)


def unsplit_reason(module: nn.Module, tp_size: int) -> Optional[str]:
    """Why ``module`` cannot be split ``tp_size`` ways by its family's plan (None when it can)."""
    try:
        resolve_hf_plan(module, tp_size)
    except ValueError as exc:
        return str(exc)
    return None


def left_whole(module: nn.Module, tp_size: int) -> str:
    """What the family's plan leaves whole on every rank of ``module`` split ``tp_size`` ways, in one line: the
    vocabulary pair when it cannot be split (with why), then the other modules holding parameters."""
    resolved = resolve_hf_plan(module, tp_size)
    vocab = resolved.vocab
    paths = [path for path in (vocab.embedding, vocab.output) if path]
    whole = [f"vocabulary {'/'.join(paths)} ({vocab.reason})"] if paths and not vocab.split else []
    whole += [f"{name} (x{count})" if count > 1 else name for name, count in resolved.unsplit if name not in paths]
    return f"{resolved.plan.family} plan, left whole: {', '.join(whole) or 'none'}"


def refuse_unbuilt(module: nn.Module, path: str, state: SMPState) -> None:
    """Raise (on every rank: every rank holds the same model and config) for what is not built yet."""
    where = f"smp tensor parallelism of the Hugging Face model {type(module).__name__} at '{path or '<model>'}'"
    if not state.config.prescaled_batch:
        raise NotImplementedError(
            f"{where}: its split layers need the same batch on every tensor-parallel rank; set 'prescaled_batch': "
            "True in smp.init and shard the data by smp.rdp_rank() / smp.rdp_size() (as AWS's GPT scripts do)"
        )
    if state.topology.mp_size > 1:
        raise NotImplementedError(
            f"{where}: with pipeline_parallel_degree={state.topology.mp_size} is not built yet; use tensor and data "
            "parallelism only, or build the model from smp.nn distributed modules"
        )
    if any(p.is_meta for p in module.parameters()):
        raise NotImplementedError(
            f"{where}: the model is on the meta device (delayed parameter initialization); splitting a delayed model "
            "is not built yet: set 'delayed_parameter_initialization': False"
        )


def split_model(module: nn.Module, state: SMPState) -> None:
    """Split ``module`` in place over smp's tensor-parallel group by its family's plan."""
    assert state.parallel_state is not None  # tensor_parallel_degree > 1
    parallelize_hf(module, state.parallel_state)
    _SPLIT.add(module)


def split_model_parameter_ids(root: nn.Module) -> frozenset[int]:
    """The parameters of the models below ``root`` that :func:`split_model` split (all of them, split or
    replicated: each has the gradient of the batch its tensor-parallel group shares)."""
    return frozenset(id(p) for m in root.modules() if m in _SPLIT for p in m.parameters())
