"""``smp.nn.DistributedTransformerLMHead`` at tensor_parallel_degree 2 against an unsplit reference written from smp's
tensor-parallel page (issue 34): word and position embeddings added, the transformer, the final layer norm of a
pre-norm stack, and a bias-free LM head tied to the word embedding. Its logits, its loss and two SGD steps equal the
reference's, with and without ``prescaled_batch``; the word embedding (and so the tied head) is split by vocabulary.
Token types, given positions and ``add_lm_head=False`` too."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed

VOCAB, HIDDEN, HEADS, POSITIONS = 32, 16, 4, 8
SIZES = {
    "num_layers": 2, "num_attention_heads": HEADS, "attention_head_size": HIDDEN // HEADS, "hidden_size": HIDDEN,
    "intermediate_size": 32, "vocab_size": VOCAB, "num_positions": POSITIONS, "attention_dropout_prob": 0.0,
    "hidden_dropout_prob": 0.0, "causal_mask_size": POSITIONS, "pre_layernorm": True, "post_layernorm": False,
}  # fmt: skip


class ReferenceAttention(nn.Module):
    """Pre-norm causal self-attention with the residual (the page's AttentionLayer, ``pre_layernorm`` only)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre_layernorm = nn.LayerNorm(HIDDEN)
        self.query, self.key, self.value, self.dense = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.pre_layernorm(hidden)
        n, length, _ = x.shape
        q, k, v = (lin(x).view(n, length, HEADS, -1).transpose(1, 2) for lin in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / (HIDDEN // HEADS) ** 0.5
        future = torch.ones(length, length, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min) + mask
        context = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(n, length, HIDDEN)
        return hidden + self.dense(context)


class ReferenceOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre_layernorm = nn.LayerNorm(HIDDEN)
        self.dense1, self.dense2 = nn.Linear(HIDDEN, 32), nn.Linear(32, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dense2(F.gelu(self.dense1(self.pre_layernorm(x))))


class ReferenceLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention, self.output = ReferenceAttention(), ReferenceOutput()


class ReferenceLM(nn.Module):
    """The page's DistributedTransformerLMHead, unsplit, under smp's parameter names."""

    def __init__(self, token_types: int = 0) -> None:
        super().__init__()
        self.word_embedding = nn.Embedding(VOCAB, HIDDEN)
        self.position_embedding = nn.Embedding(POSITIONS, HIDDEN)
        if token_types:
            self.token_type_embedding = nn.Embedding(token_types, HIDDEN)
        self.transformer = nn.Module()
        self.transformer.seq_layers = nn.ModuleList(ReferenceLayer() for _ in range(2))
        self.layernorm = nn.LayerNorm(HIDDEN)

    def hidden(self, ids: torch.Tensor, masked: torch.Tensor, types: Any = None, positions: Any = None) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]) if positions is None else positions
        h = self.word_embedding(ids) + self.position_embedding(positions)
        if types is not None:
            h = h + self.token_type_embedding(types)
        mask = masked[:, None, None, :].float() * torch.finfo(torch.float32).min  # 1 marks a masked position
        for layer in self.transformer.seq_layers:
            h = layer.output(layer.attention(h, mask))
        return self.layernorm(h)

    def forward(self, ids: torch.Tensor, masked: torch.Tensor, labels: Any = None) -> torch.Tensor:
        logits = self.hidden(ids, masked) @ self.word_embedding.weight.t()  # the head is tied to the word embedding
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (4, POSITIONS), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((4, 1), -100)], dim=1)  # next tokens; the last one not counted
    masked = torch.zeros(4, POSITIONS, dtype=torch.long)
    masked[1::2, -2:] = 1  # padding at the end of every other row
    return ids, masked, labels


@smp.step
def _logits(model: smp.DistributedModel, ids: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    return model((ids, masked))


@smp.step
def _train(model: smp.DistributedModel, ids: torch.Tensor, masked: torch.Tensor, labels: torch.Tensor) -> Any:
    loss = model((ids, masked, None, None, labels))
    model.backward(loss)
    return loss


def _compare(prescaled: bool) -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": prescaled})
    try:
        torch.manual_seed(0)
        lm = smp.nn.DistributedTransformerLMHead(**SIZES)
        model = smp.DistributedModel(lm)
        reference = ReferenceLM()
        reference.load_state_dict(model.state_dict())  # strict: the merged slices under the reference's names
        out: dict[str, Any] = {"local word rows": lm.word_embedding.weight.shape[0]}
        parts, index = (smp.rdp_size(), smp.rdp_rank()) if prescaled else (smp.dp_size(), smp.dp_rank())
        ids, masked, _ = _batch(0)
        with torch.no_grad():
            mine = _logits(model, ids.chunk(parts)[index], masked.chunk(parts)[index]).concat()
            out["logits"] = (mine - reference(ids, masked).chunk(parts)[index]).abs().max().item()
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
        plain = torch.optim.SGD(reference.parameters(), lr=0.5)
        out["losses"] = []
        for step in range(2):
            batch = _batch(step)
            optimizer.zero_grad()
            loss = _train(model, *(t.chunk(parts)[index] for t in batch)).reduce_mean().item()
            optimizer.step()
            plain.zero_grad()
            theirs = reference(*batch)
            theirs.backward()
            plain.step()
            ours = sum(smp.allgather(loss, smp.DP_GROUP)) / smp.dp_size()
            out["losses"].append((ours, theirs.item()))
        after = model.state_dict()
        out["weights"] = max((after[k] - v).abs().max().item() for k, v in reference.state_dict().items())
        return out
    finally:
        smp.reset()


@smp.step
def _hidden(model: smp.DistributedModel, *inputs: torch.Tensor) -> torch.Tensor:
    out = model(inputs)
    model.backward(out.square().mean())
    return out


def _token_types_without_head() -> dict[str, float]:
    """``num_token_types``, ``position_ids`` and ``add_lm_head=False``: the hidden states and one step's gradients,
    each rank on its own batch (no ``prescaled_batch``)."""
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    try:
        torch.manual_seed(0)
        model = smp.DistributedModel(smp.nn.DistributedTransformerLMHead(num_token_types=2, add_lm_head=False, **SIZES))
        reference = ReferenceLM(token_types=2)
        reference.load_state_dict(model.state_dict())
        ids, masked, _ = _batch(3)
        types, positions = (ids % 2), torch.arange(POSITIONS).flip(0).expand(4, -1)
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
        optimizer.zero_grad()
        mine = [t.chunk(smp.dp_size())[smp.dp_rank()] for t in (ids, masked, types, positions)]
        ours = _hidden(model, *mine).concat()
        optimizer.step()
        theirs = reference.hidden(ids, masked, types, positions)
        theirs.square().mean().backward()
        torch.optim.SGD(reference.parameters(), lr=1.0).step()
        after = model.state_dict()
        return {
            "hidden": (ours - theirs.detach().chunk(smp.dp_size())[smp.dp_rank()]).abs().max().item(),
            "weights": max((after[k] - v).abs().max().item() for k, v in reference.state_dict().items()),
        }
    finally:
        smp.reset()


def _both(rank: int, world_size: int) -> dict[Any, dict[str, Any]]:
    out: dict[Any, dict[str, Any]] = {prescaled: _compare(prescaled) for prescaled in (True, False)}
    out["token types"] = _token_types_without_head()
    return out


def test_lm_head_at_tp2_equals_the_unsplit_reference_with_and_without_prescaled_batch() -> None:
    for result in run_distributed(_both, 2):
        extra = result.pop("token types")
        assert extra["hidden"] < 1e-5 and extra["weights"] < 1e-5, extra
        for prescaled, got in result.items():
            assert got["local word rows"] == VOCAB // 2, (prescaled, got)
            assert got["logits"] < 1e-5, (prescaled, got)
            for ours, theirs in got["losses"]:
                assert abs(ours - theirs) < 1e-5, (prescaled, got)
            assert got["weights"] < 1e-5, (prescaled, got)


def _pipeline(rank: int, world_size: int) -> dict[str, Any]:
    """TP 2 x pipeline 2: rank 0 traces the LM head alone to partition it, then two micro-batches run two steps."""
    smp.init({"tensor_parallel_degree": 2, "partitions": 2, "microbatches": 2, "ddp": True, "prescaled_batch": True})
    try:
        torch.manual_seed(0)
        model = smp.DistributedModel(smp.nn.DistributedTransformerLMHead(**SIZES))
        reference = ReferenceLM()
        reference.load_state_dict(model.state_dict())  # before the first step: the whole model on every stage
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
        plain = torch.optim.SGD(reference.parameters(), lr=0.5)
        losses = []
        for step in range(2):
            batch = _batch(step)
            optimizer.zero_grad()
            ours = _train(model, *batch).reduce_mean().item()
            optimizer.step()
            plain.zero_grad()
            # every row counts the same number of labels: the mean of the micro-batches' means is the batch mean
            theirs = reference(*batch)
            theirs.backward()
            plain.step()
            losses.append((ours, theirs.item()))
        return {"losses": losses, "pp_rank": smp.pp_rank()}
    finally:
        smp.reset()


def test_lm_head_at_tp2_x_pipeline2_trains_equal_to_the_reference() -> None:
    results = run_distributed(_pipeline, 4)
    assert sorted(r["pp_rank"] for r in results) == [0, 0, 1, 1], results
    for result in results:
        for ours, theirs in result["losses"]:
            assert abs(ours - theirs) < 1e-5, result
