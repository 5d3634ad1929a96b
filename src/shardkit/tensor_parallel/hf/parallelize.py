"""``parallelize_hf``: split a Hugging Face model across the tensor-parallel ranks, in place, by its family's plan.

The order: resolve the plan (pure arithmetic: the same answer, or the same error, on every rank), agree across the
tensor-parallel ranks that every rank resolved it and holds the same model with the same values (one small
all-gather; a rank whose model was built from another seed would otherwise be split into a mix of two models), and
only then replace the modules. Child modules are replaced (``setattr`` on the parent) and the attention modules'
head-count attributes divided; no ``forward`` is patched.
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from shardkit.distributed.collectives import all_reduce
from shardkit.distributed.model_check import check_same_model
from shardkit.distributed.objects import all_gather_objects
from shardkit.tensor_parallel.hf.dropout import SplitDropoutRegion
from shardkit.tensor_parallel.hf.layers import (
    Conv1DColumnParallel,
    Conv1DRowParallel,
    column_from_linear,
    row_from_linear,
    vocab_embedding_from,
)
from shardkit.tensor_parallel.hf.plans import HFPlan
from shardkit.tensor_parallel.hf.resolve import ResolvedHFPlan, resolve_hf_plan
from shardkit.tensor_parallel.sharding import TPGroup
from shardkit.tensor_parallel.state import ParallelState

logger = logging.getLogger("shardkit.tensor_parallel.hf")

_WHO = "parallelize_hf"


def _build(style: str, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """The split replacement of ``module`` (whose type resolve_hf_plan checked against ``style``)."""
    if style.startswith("conv1d"):
        if style == "conv1d_rowwise":
            return Conv1DRowParallel(module, mesh=mesh)
        return Conv1DColumnParallel(module, stride=3 if style == "conv1d_fused_qkv" else 1, mesh=mesh)
    if style == "embedding_rowwise":
        assert isinstance(module, nn.Embedding)
        return vocab_embedding_from(module, mesh=mesh)
    assert isinstance(module, nn.Linear)
    if style.startswith("rowwise"):
        return row_from_linear(module, input_is_parallel=style == "rowwise", mesh=mesh)
    return column_from_linear(module, gather_output=style == "colwise_gather_output", mesh=mesh)


def parallelize_hf(
    model: nn.Module,
    mesh: Union[ParallelState, DeviceMesh, None] = None,
    *,
    plan: Optional[HFPlan] = None,
    split_vocab: Optional[bool] = None,
) -> nn.Module:
    """Split a Hugging Face ``model`` across the tensor-parallel ranks, in place, and return it.

    Supported out of the box: GPT-2 (fused ``c_attn`` ``Conv1D`` split per head), GPT-J, GPT-Neo, BERT, RoBERTa, and
    every model whose config carries transformers' own ``base_model_tp_plan`` (Llama and Llama-style families),
    its ``colwise``/``rowwise``/``embedding_rowwise`` entries mapped onto shardkit's layers. Attention and
    feed-forward blocks become column-then-row pairs (one all-reduce each way per block); the attention modules'
    head counts become per-rank counts; the vocabulary pair is split by rows when the degree divides it and ties
    allow (see :mod:`shardkit.tensor_parallel.hf.vocab`), its logits gathered so HF's loss and ``generate()`` work.
    What stays whole is logged once (logger ``shardkit.tensor_parallel.hf``). Dropout on this rank's heads draws a
    different mask on each rank, dropout on replicated activations the same one (:mod:`.dropout`; keep the default
    generator in the same state on every tensor-parallel rank: ``model_parallel_manual_seed`` or one
    ``torch.manual_seed``), also under HF's gradient checkpointing.

    Every rank of the tensor-parallel group calls it with the same model (same weights: build it from the same
    seed or load the same checkpoint). A degree that does not divide a head count, hidden, intermediate or vocabulary
    size raises ``ValueError`` on every rank, naming the modules, the sizes and the degrees that would fit, before
    anything is changed; so does a rank holding a different model.

    Args:
        model: a ``transformers`` ``PreTrainedModel`` (or a base model), on its device, in its dtype.
        mesh: the :class:`ParallelState` or the 1-D tensor-parallel ``DeviceMesh``; the current state when None.
        plan: a plan to use instead of the registered one (:func:`hf_plan_for`).
        split_vocab: None splits the vocabulary pair when possible, else keeps it whole; True requires the split;
            False keeps it whole.

    Example::

        state = shardkit.tensor_parallel.init_parallel_state(tensor=2)
        model = GPT2LMHeadModel.from_pretrained("gpt2")        # on every rank
        parallelize_hf(model, state)
        model.generate(ids, max_new_tokens=20)                  # same tokens as the whole model
    """
    tp_mesh = mesh.tp_mesh if isinstance(mesh, ParallelState) else mesh
    tp = TPGroup.of(tp_mesh, _WHO)
    resolved: Optional[ResolvedHFPlan] = None
    error: Optional[Exception] = None
    try:
        resolved = resolve_hf_plan(model, tp.size, plan, split_vocab)
    except Exception as exc:  # any rank's failure travels to every rank in the check below: none is left waiting
        error = exc
    check_same_model(model, tp.group, _WHO, local_error=error)
    _check_same_values(model, tp)
    assert resolved is not None
    _apply(model, resolved, tp.mesh)
    for path, replicated in resolved.dropout_regions:
        SplitDropoutRegion(model.get_submodule(path), tp.rank, replicated)
    for path in resolved.grad_sums:
        for param in model.get_submodule(path).parameters():
            if param.requires_grad:
                param.register_hook(_GradSum(tp.group))
    if tp.rank == 0:
        _log(resolved)
    return model


class _GradSum:
    """A parameter hook summing the gradient over the tensor-parallel ranks (the group is captured here, so the hook
    reads nothing from the caller's context on autograd's threads)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        total = grad.contiguous().clone()
        all_reduce(total, group=self.group, label="tp.replicated_grad")
        return total


def _fingerprint(model: nn.Module) -> list[list[float]]:
    """Sum and 2-norm of every parameter, in float64 without copying it, read back in one transfer. A parameter on
    the meta device (a model built for delayed initialisation) has no values yet: it counts as zeros."""
    params = list(model.parameters())
    with torch.no_grad():
        stats = [
            torch.stack([p.sum(dtype=torch.float64), torch.linalg.vector_norm(p, dtype=torch.float64)])
            for p in params
            if not p.is_meta
        ]
        real = iter(torch.stack(stats).cpu().tolist() if stats else [])
    return [[0.0, 0.0] if p.is_meta else next(real) for p in params]


def _check_same_values(model: nn.Module, tp: TPGroup) -> None:
    """Raise on every rank unless the tensor-parallel ranks hold the same parameter values (compared by sum and
    norm per tensor: each rank keeps its slice of its own copy, so different copies would mix)."""
    everyone = all_gather_objects(_fingerprint(model), tp.group, f"{_WHO}.value_check")
    names = [name for name, _ in model.named_parameters()]
    for rank, other in enumerate(everyone[1:], start=1):
        for name, ours, theirs in zip(names, everyone[0], other):
            if ours != theirs:
                raise ValueError(
                    f"{_WHO}: tensor-parallel ranks 0 and {rank} hold different values of '{name}'. Every rank must "
                    "start from the same model (torch.manual_seed before building it, or from_pretrained of the "
                    "same checkpoint): each keeps its own slice, so different copies would be mixed. Nothing was "
                    "changed."
                )


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    old = getattr(parent, child)
    reference = next(old.parameters(), None)
    if reference is not None:
        new = new.to(device=reference.device, dtype=reference.dtype)
    new.train(old.training)
    setattr(parent, child, new)


def _apply(model: nn.Module, resolved: ResolvedHFPlan, mesh: DeviceMesh) -> None:
    for path, style in resolved.layers:
        _replace(model, path, _build(style, model.get_submodule(path), mesh))
    for path, attribute, value in resolved.head_updates:
        setattr(model.get_submodule(path), attribute, value)
    vocab = resolved.vocab
    if not vocab.split:
        return
    source = model.get_submodule(vocab.embedding)
    assert isinstance(source, nn.Embedding)  # resolve_hf_plan splits only an nn.Embedding
    embedding = vocab_embedding_from(source, mesh=mesh)
    _replace(model, vocab.embedding, embedding)
    if vocab.output:
        output = model.get_submodule(vocab.output)
        assert isinstance(output, nn.Linear)
        head = column_from_linear(output, gather_output=True, mesh=mesh)
        _replace(model, vocab.output, head)
        if vocab.tied:
            head.weight = embedding.weight  # one Parameter, split the same way on both sides


def _log(resolved: ResolvedHFPlan) -> None:
    vocab = resolved.vocab
    vocab_text = (
        f"split by vocabulary ({'tied' if vocab.tied else 'untied'})"
        if vocab.split
        else f"kept whole on every rank ({vocab.reason})"
    )
    logger.info(
        "parallelize_hf: %s plan (%s) at tensor-parallel degree %d: %d modules split; vocabulary %s; left whole on "
        "every rank: %s%s",
        resolved.plan.family,
        resolved.plan.source,
        resolved.tp_size,
        len(resolved.layers) + len(vocab.split_modules),
        vocab_text,
        resolved.describe_unsplit(),
        f" (gradients summed over the ranks: {len(resolved.grad_sums)} of them)" if resolved.grad_sums else "",
    )
