"""Tensor-parallel plans for Hugging Face model families: which modules split how, and which attention attributes
count heads.

A plan names modules by patterns relative to the model's *base* model (``model.base_model``: ``GPT2Model`` inside
``GPT2LMHeadModel``), as transformers' own ``config.base_model_tp_plan`` does; ``*`` matches one path component (the
layer index). The styles:

* ``colwise``: an ``nn.Linear`` split by output features (its output stays split: this rank's heads or its slice
  of the feed-forward's inner dimension);
* ``rowwise``: an ``nn.Linear`` split by input features, its output summed over the ranks (one all-reduce);
* ``colwise_gather_output`` / ``rowwise_split_input`` (transformers' names): the same layers taking or giving whole
  activations, for modules whose neighbours need every feature (a norm over all heads' q, a ``chunk`` of a fused
  output): the column layer all-gathers its output, the row layer keeps its slice of a whole input;
* ``conv1d_colwise`` / ``conv1d_rowwise``: the same for HF's ``Conv1D`` (weight stored ``(in, out)``);
* ``conv1d_fused_qkv``: a ``Conv1D`` computing ``[q | k | v]`` at once, split per head: each rank keeps its
  heads' columns of q, of k and of v (never a third of the fused weight's rows, which would give rank 0 all of q);
* ``embedding_rowwise``: an ``nn.Embedding`` split by vocabulary rows (transformers' name for it);
* ``replicated_with_grad_allreduce``: a module left whole that acts on split activations (Qwen3's per-head
  ``q_norm``): each rank's gradient covers its heads only, so its parameters' gradients are summed over the ranks
  (else the copies drift apart).

The input embedding and the output layer (``get_input_embeddings()`` / ``get_output_embeddings()``) are not
named: :mod:`.vocab` splits them together by vocabulary, or keeps them replicated, so a tied pair stays tied.

``head_attributes`` names, per attention module pattern, the integer attributes its ``forward`` divides by the
local head count (``num_heads``, ``split_size``...): each is divided by the tensor-parallel degree, so the module
views its output as this rank's heads. Families whose attention infers the head count from the tensor (``view(...,
-1, head_dim)``: transformers' ``base_model_tp_plan`` models) need none.

``dropout_regions`` names, per attention module pattern, the children that act on the replicated output (GPT-2's
``resid_dropout``): the module's other dropout, on this rank's heads, draws a different mask on each rank (see
:mod:`.dropout`). A model without regions keeps every dropout on the default generator (correct, but each rank's
heads then share the other ranks' masks).

Models with a ``config.base_model_tp_plan`` use it (GPT-J, Llama and many Llama-style families); the registry adds
the families smp v1 split automatically that have none (GPT-2, GPT-Neo, BERT, RoBERTa).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

#: The styles a plan may use (see the module docstring).
STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "rowwise_split_input",
    "conv1d_colwise",
    "conv1d_rowwise",
    "conv1d_fused_qkv",
    "embedding_rowwise",
    "replicated_with_grad_allreduce",
)


@dataclass(frozen=True)
class HFPlan:
    """How one family splits: module pattern -> style, and attention pattern -> head-count attributes.

    Attributes:
        family: the name in logs and errors (``config.model_type``).
        layers: base-model-relative module pattern -> one of :data:`STYLES`.
        head_attributes: base-model-relative attention-module pattern -> attributes divided by the degree.
        source: where the layer styles came from (``"shardkit"`` or ``"config.base_model_tp_plan"``).
        dropout_regions: base-model-relative attention-module pattern -> names of its children that act on the
            replicated output (their dropout masks must agree across ranks).
    """

    family: str
    layers: Mapping[str, str]
    head_attributes: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    source: str = "shardkit"
    dropout_regions: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        unknown = sorted({style for style in self.layers.values() if style not in STYLES})
        if unknown:
            raise ValueError(
                f"tensor-parallel plan for '{self.family}' ({self.source}) uses styles shardkit does not split: "
                f"{unknown}; supported: {list(STYLES)}. Register a plan with shardkit's styles "
                "(shardkit.tensor_parallel.hf.register_hf_plan)."
            )


def _plan(
    family: str,
    layers: Mapping[str, str],
    heads: Mapping[str, tuple[str, ...]],
    regions: Mapping[str, tuple[str, ...]],
) -> HFPlan:
    return HFPlan(
        family,
        MappingProxyType(dict(layers)),
        MappingProxyType(dict(heads)),
        "shardkit",
        MappingProxyType(dict(regions)),
    )


_BERT_LAYERS = {
    f"encoder.layer.*.{attention}.self.{name}": "colwise"
    for attention in ("attention", "crossattention")
    for name in ("query", "key", "value")
}
_BERT_LAYERS.update(
    {
        "encoder.layer.*.attention.output.dense": "rowwise",
        "encoder.layer.*.crossattention.output.dense": "rowwise",
        "encoder.layer.*.intermediate.dense": "colwise",
        "encoder.layer.*.output.dense": "rowwise",
    }
)
_BERT_HEADS = {
    f"encoder.layer.*.{attention}.self": ("num_attention_heads", "all_head_size")
    for attention in ("attention", "crossattention")
}

_BERT_REGIONS: dict[str, tuple[str, ...]] = {pattern: () for pattern in _BERT_HEADS}

_REGISTRY: dict[str, HFPlan] = {
    "gpt2": _plan(
        "gpt2",
        {
            "h.*.attn.c_attn": "conv1d_fused_qkv",
            "h.*.attn.c_proj": "conv1d_rowwise",
            "h.*.mlp.c_fc": "conv1d_colwise",
            "h.*.mlp.c_proj": "conv1d_rowwise",
        },
        {"h.*.attn": ("num_heads", "split_size")},
        {"h.*.attn": ("resid_dropout",)},
    ),
    "gpt_neo": _plan(
        "gpt_neo",
        {
            "h.*.attn.attention.q_proj": "colwise",
            "h.*.attn.attention.k_proj": "colwise",
            "h.*.attn.attention.v_proj": "colwise",
            "h.*.attn.attention.out_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        {"h.*.attn.attention": ("num_heads",)},
        {"h.*.attn.attention": ("resid_dropout",)},
    ),
    "bert": _plan("bert", _BERT_LAYERS, _BERT_HEADS, _BERT_REGIONS),
    "roberta": _plan("roberta", _BERT_LAYERS, _BERT_HEADS, _BERT_REGIONS),
}

#: Head-count attributes and dropout regions of families whose layer styles come from ``config.base_model_tp_plan``.
_CONFIG_PLAN_HEADS: dict[str, dict[str, tuple[str, ...]]] = {"gptj": {"h.*.attn": ("num_attention_heads",)}}
_CONFIG_PLAN_REGIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "gptj": {"h.*.attn": ("resid_dropout",)},
    "llama": {"layers.*.self_attn": ()},
}


def register_hf_plan(model_type: str, plan: HFPlan) -> None:
    """Use ``plan`` for models whose ``config.model_type`` is ``model_type`` (replacing any registered one).

    Example::

        register_hf_plan("my_gpt", HFPlan("my_gpt", {"blocks.*.qkv": "colwise", "blocks.*.out": "rowwise"},
                                          {"blocks.*": ("n_heads",)}))
    """
    _REGISTRY[model_type] = plan


def hf_plan_for(config: Any) -> HFPlan:
    """The plan for a model with this ``config``: shardkit's registered one, else transformers' own
    ``config.base_model_tp_plan``; ``ValueError`` naming the supported families when there is neither."""
    model_type = str(getattr(config, "model_type", type(config).__name__))
    if model_type in _REGISTRY:
        return _REGISTRY[model_type]
    config_plan = getattr(config, "base_model_tp_plan", None)
    if config_plan:
        heads = _CONFIG_PLAN_HEADS.get(model_type, {})
        return HFPlan(
            model_type,
            MappingProxyType(dict(config_plan)),
            MappingProxyType(heads),
            source="config.base_model_tp_plan",
            dropout_regions=MappingProxyType(_CONFIG_PLAN_REGIONS.get(model_type, {})),
        )
    raise ValueError(
        f"no tensor-parallel plan for Hugging Face model type '{model_type}': shardkit knows "
        f"{sorted(_REGISTRY)} and any model whose config has a base_model_tp_plan (GPT-J, Llama, Mistral, "
        "Qwen2...). Register one with shardkit.tensor_parallel.hf.register_hf_plan."
    )
