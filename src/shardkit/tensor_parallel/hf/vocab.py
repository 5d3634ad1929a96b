"""The vocabulary: the input embedding and the output layer, split together by vocabulary rows or kept whole.

Most language models tie the output layer's weight to the input embedding's (one ``Parameter`` held by both).
Splitting one side only would leave two different tensors where training expects one, so the pair is decided
together: both split the same way (rows ``[r V/t, (r+1) V/t)`` of the shared weight on rank ``r``, still one
``Parameter``), or both kept whole. They are kept whole, and the log says why, when the degree does not divide the
vocabulary (GPT-2's 50257 tokens), when another module also holds one of their tensors (BERT's prediction head keeps
the output bias a second time), or when ``split_vocab=False``; ``split_vocab=True`` turns each of those into an
error. The output layer gathers its logits (``gather_output=True``), so the model's own loss and ``generate()``
see the full vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from shardkit.tensor_parallel.hf.problem import Problem, is_exactly


@dataclass(frozen=True)
class VocabDecision:
    """How the vocabulary pair is treated.

    Attributes:
        split: whether the pair is split by vocabulary.
        embedding, output: their module paths ("" when the model has none).
        tied: whether they hold one weight.
        reason: why they stay whole (empty when split).
        sizes: what the degree check must see: the vocabulary when ``split_vocab=True``, or why that split is
            impossible.
    """

    split: bool
    embedding: str
    output: str
    tied: bool
    reason: str
    sizes: tuple[Problem, ...]

    @property
    def handled(self) -> frozenset[str]:
        """The paths this decision owns (a plan's entries for them are ignored)."""
        return frozenset(p for p in (self.embedding, self.output) if p)

    @property
    def split_modules(self) -> tuple[str, ...]:
        """The paths replaced by split modules."""
        return tuple(p for p in (self.embedding, self.output) if p and self.split)


def _path(model: nn.Module, module: Optional[nn.Module]) -> str:
    if module is None:
        return ""
    return next((name for name, m in model.named_modules() if m is module), "")


def _shared_elsewhere(model: nn.Module, owners: dict[str, torch.Tensor]) -> list[str]:
    """Names under which ``model`` holds one of ``owners``' tensors beyond the names in ``owners``."""
    wanted = {id(p) for p in owners.values()}
    return [
        name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in wanted and name not in owners
    ]


def decide_vocab(model: nn.Module, tp_size: int, split_vocab: Optional[bool]) -> VocabDecision:
    """Decide how ``model``'s vocabulary pair is treated at ``tp_size`` (see the module docstring)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    output = get_out() if callable(get_out) else None
    emb_path, out_path = _path(model, embedding), _path(model, output)
    tied = isinstance(output, nn.Module) and isinstance(embedding, nn.Module) and output.weight is embedding.weight
    owners: dict[str, torch.Tensor] = (
        {f"{emb_path}.weight": embedding.weight} if isinstance(embedding, nn.Embedding) else {}
    )
    if isinstance(output, nn.Linear):
        owners[f"{out_path}.weight"] = output.weight
        if output.bias is not None:
            owners[f"{out_path}.bias"] = output.bias
    reason = ""
    if not is_exactly(embedding, nn.Embedding):
        reason = f"the input embedding '{emb_path}' is {type(embedding).__name__}, not nn.Embedding"
    elif output is not None and not is_exactly(output, nn.Linear):
        reason = f"the output layer '{out_path}' is {type(output).__name__}, not nn.Linear"
    elif _shared_elsewhere(model, owners):
        reason = f"'{_shared_elsewhere(model, owners)[0]}' also holds one of their tensors"
    elif embedding.num_embeddings % tp_size or (output is not None and output.out_features % tp_size):
        reason = f"{tp_size} does not divide the vocabulary ({embedding.num_embeddings})"
    elif split_vocab is False:
        reason = "split_vocab=False"
    # The vocabulary constrains the degree only when its split is required: otherwise it is kept whole if need be.
    vocab_size = (
        (Problem(emb_path, "num_embeddings", embedding.num_embeddings),)
        if split_vocab and isinstance(embedding, nn.Embedding)
        else ()
    )
    if not reason:
        return VocabDecision(True, emb_path, out_path, tied, "", vocab_size)
    if split_vocab and reason.startswith(str(tp_size)):
        return VocabDecision(False, emb_path, out_path, tied, reason, vocab_size)
    if split_vocab:
        refused = (Problem(emb_path or type(model).__name__, f"split_vocab=True, but {reason}"),)
        return VocabDecision(False, emb_path, out_path, tied, reason, refused)
    return VocabDecision(False, emb_path, out_path, tied, reason, ())
