"""Tensor parallelism for Hugging Face ``transformers`` models: a plan per family, applied by :func:`parallelize_hf`.

* :mod:`.plans`: the registry (GPT-2, GPT-Neo, BERT, RoBERTa written here; GPT-J, Llama and every model whose config
  has a ``base_model_tp_plan`` from transformers' own plan) and :func:`register_hf_plan` for more;
* :mod:`.resolve`: what a plan does to one model at one degree, without changing it (:func:`resolve_hf_plan`),
  and the degree check;
* :mod:`.vocab`: the input embedding and output layer, split together or kept whole (tied weights stay tied);
* :mod:`.layers`: the split layers built from the model's own modules (HF ``Conv1D`` orientation kept);
* :mod:`.parallelize`: the cross-rank agreement and the replacement.

Example::

    from shardkit import tensor_parallel as tp

    state = tp.init_parallel_state(tensor=2)           # torchrun --nproc-per-node 2
    tp.model_parallel_manual_seed(1234, state.tp_rank)
    model = AutoModelForCausalLM.from_pretrained(name)  # the same weights on every rank
    tp.parallelize_hf(model, state)                     # logits, loss and generate() as before, half the weights
"""

from shardkit.tensor_parallel.hf.parallelize import parallelize_hf
from shardkit.tensor_parallel.hf.plans import STYLES, HFPlan, hf_plan_for, register_hf_plan
from shardkit.tensor_parallel.hf.resolve import ResolvedHFPlan, resolve_hf_plan
from shardkit.tensor_parallel.hf.vocab import VocabDecision

__all__ = [
    "STYLES",
    "HFPlan",
    "ResolvedHFPlan",
    "VocabDecision",
    "hf_plan_for",
    "parallelize_hf",
    "register_hf_plan",
    "resolve_hf_plan",
]
