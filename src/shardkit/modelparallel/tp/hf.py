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
group (see :func:`split_model_parameter_ids`). Not built, and refused on every rank before anything changes:
``prescaled_batch: False`` (each rank its own batch), and delayed initialisation of a model whose plan sums some
whole modules' gradients over the ranks (Qwen3's ``q_norm``: the hooks would sit on the replaced meta tensors).

With a pipeline, rank 0 traces the split model alone to partition it: the split layers' collectives complete
locally there (:func:`~shardkit.distributed.rehearsal.local_rehearsal`). A model built for delayed parameter
initialisation (on the meta device) is split on the meta device too; each split layer remembers the whole module it
replaced (:func:`whole_module_of`), through which delayed initialisation creates the layer's slices: the whole
module is initialised at full size in its place, as in the unsplit model, and each rank keeps its slices. So the
split model starts from exactly the values the unsplit delayed model would, at any tensor-parallel degree.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from shardkit.modelparallel.building.delayed_init import WholeModule, delay_param_initialization, is_delayed
from shardkit.modelparallel.state import SMPState
from shardkit.modelparallel.tp.registry import Mark, mark_of
from shardkit.tensor_parallel import TensorParallelModule
from shardkit.tensor_parallel.hf import parallelize_hf, resolve_hf_plan

#: The models split by :func:`split_model` (weak: a dropped model takes its entry).
_SPLIT: weakref.WeakSet[nn.Module] = weakref.WeakSet()
#: Each split layer of a delayed model -> the whole module (on the meta device) it replaced.
_WHOLE: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


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
    if is_delayed(module) and _gradient_sums(module, state.topology.tp_size):
        # Their gradient hooks sit on the meta tensors, which delayed initialisation replaces: the sums would be lost.
        raise NotImplementedError(
            f"{where}: its plan leaves modules whole whose gradients are summed over the tensor-parallel ranks "
            f"({', '.join(_gradient_sums(module, state.topology.tp_size))}); with delayed parameter initialization "
            "that is not built yet: set 'delayed_parameter_initialization': False"
        )


def _gradient_sums(module: nn.Module, tp_size: int) -> tuple[str, ...]:
    try:
        return resolve_hf_plan(module, tp_size).grad_sums
    except ValueError:  # left unsplit: listed by unsplit_reason
        return ()


def split_model(module: nn.Module, state: SMPState) -> None:
    """Split ``module`` in place over smp's tensor-parallel group by its family's plan (on the meta device, each
    split layer remembering the whole module it replaced, when the model awaits delayed initialisation)."""
    assert state.parallel_state is not None  # tensor_parallel_degree > 1
    if not is_delayed(module):
        parallelize_hf(module, state.parallel_state)
        _SPLIT.add(module)
        return
    before = dict(module.named_modules())
    with delay_param_initialization():  # the split layers' tensors are created on meta, marked as delayed
        parallelize_hf(module, state.parallel_state)
    for name, layer in module.named_modules():
        if isinstance(layer, TensorParallelModule) and before.get(name) not in (None, layer):
            _WHOLE[layer] = before[name]
    _SPLIT.add(module)


def whole_module_of(layer: nn.Module) -> Optional[WholeModule]:
    """For a split layer of a delayed model: the whole module it replaced and how to cut each of its tensors into
    this rank's slice (see :func:`~shardkit.modelparallel.building.delayed_init.materialize`); None for any other
    module."""
    whole = _WHOLE.get(layer)
    if whole is None:
        return None
    assert isinstance(layer, TensorParallelModule)
    specs, tp = dict(layer.tp_specs), layer.tp

    def cut(name: str, full: torch.Tensor) -> torch.Tensor:
        spec = specs.get(name)
        return full if spec is None else spec.shard(full, tp.rank, tp.size)

    return WholeModule(whole, cut)


def split_model_parameter_ids(root: nn.Module) -> frozenset[int]:
    """The parameters of the models below ``root`` that :func:`split_model` split (all of them, split or
    replicated: each has the gradient of the batch its tensor-parallel group shares)."""
    return frozenset(id(p) for m in root.modules() if m in _SPLIT for p in m.parameters())
