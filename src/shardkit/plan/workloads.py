"""Picklable descriptions of a model, one rank's batch and its loss: what the planner and the real runs share.

A :class:`Workload` names a model (the bench LM, the demo LM, a transformers config with overrides, or any
``package.module:factory``), the shape of one rank's token batch, and the optimizer and strategy options. It can
be sent to worker processes, so the accuracy checks build exactly what the planner built.

A transformers config is built with the head its task needs (:mod:`shardkit.plan.hf_tasks`): a causal LM, a masked
LM (BERT), a sequence-to-sequence LM (T5) or an image classifier (ViT), with transformers' default attention
(SDPA where the model supports it), as a training script would build it.

Example::

    work = Workload.hf("gpt2", {"n_layer": 2, "n_embd": 128}, batch_size=2, seq_len=64)
    model, batch = work.build(), work.batch()
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.models import LMConfig, TransformerLM
from shardkit.models.smp_lm import SMPLMConfig, smp_lm
from shardkit.plan.hf_tasks import ATTENTION, TASKS, build_hf, hf_batch, hf_loss, task_of
from shardkit.plan.runner import PlanError
from shardkit.plan.strategies import block_classes
from shardkit.utils.checks import at_least

#: Model kinds a workload can name.
KINDS = ("bench_lm", "demo_lm", "smp_lm", "hf", "factory")


@dataclass(frozen=True)
class Workload:
    """A model, one rank's batch of tokens ``(batch_size, seq_len)`` and a next-token loss."""

    #: One of :data:`KINDS`.
    kind: str
    #: transformers model type (``"gpt2"``, ``"llama"``) or a local ``config.json`` (or the folder holding it), or
    #: ``package.module:factory``; empty for the LMs.
    name: str = ""
    #: transformers config overrides, or keyword arguments of the factory.
    overrides: Mapping[str, Any] = field(default_factory=dict)
    #: Sequences per rank.
    batch_size: int = 2
    #: Tokens per sequence.
    seq_len: int = 128
    #: Optimizer class.
    optimizer: type = torch.optim.AdamW
    #: Optimizer keyword arguments.
    optimizer_options: Mapping[str, Any] = field(default_factory=dict)
    #: Strategy constructor keyword arguments.
    strategy_options: Mapping[str, Any] = field(default_factory=dict)
    #: Consecutive ranks per node (None: no node layout).
    nprocs_per_node: Optional[int] = None
    #: Wrap every block (each module held in an ``nn.ModuleList``) in activation checkpointing, and with
    #: ``offload_activations`` move the checkpoints' saved inputs to host memory.
    activation_checkpointing: bool = False
    offload_activations: bool = False
    #: transformers models: the task whose head is built (one of :data:`~shardkit.plan.hf_tasks.TASKS`; set by
    #: :meth:`hf` from the config) and the attention implementation (empty: transformers' default, SDPA where the
    #: model supports it; or ``"eager"``, ``"sdpa"``).
    task: str = ""
    attention: str = ""
    #: Tensor-parallel degree: the model (a factory building :mod:`shardkit.tensor_parallel` layers) is built inside
    #: a ``data x tensor_parallel`` layout and the strategy runs over the data-parallel ranks.
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Workload.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        at_least(self, "batch_size", self.batch_size, 1)
        at_least(self, "seq_len", self.seq_len, 1)
        if self.offload_activations and not self.activation_checkpointing:
            raise ValueError("Workload.offload_activations needs activation_checkpointing=True")
        if self.kind == "hf":
            if self.attention not in ATTENTION:
                raise ValueError(f"Workload.attention must be one of {ATTENTION}, got {self.attention!r}")
            if not self.task:  # resolved once, so every copy builds, feeds and scores the same head
                object.__setattr__(self, "task", task_of(self.hf_config()))
            elif self.task not in TASKS:
                raise ValueError(f"Workload.task must be one of {', '.join(TASKS)}, got {self.task!r}")

    @classmethod
    def bench_lm(cls, **kwargs: Any) -> Workload:
        """The benchmarks' GPT-style LM (:meth:`LMConfig.bench`), sequence 128."""
        return cls("bench_lm", seq_len=128, **kwargs)

    @classmethod
    def demo_lm(cls, **kwargs: Any) -> Workload:
        """The demo's LM (:meth:`LMConfig.demo`), sequence 32."""
        return cls("demo_lm", seq_len=32, **kwargs)

    @classmethod
    def smp_lm(cls, **kwargs: Any) -> Workload:
        """The LM of smp's tensor-parallel blocks (:func:`shardkit.models.smp_lm.smp_lm`; built after ``smp.init``,
        so planned with the ``smp`` strategy), sequence 64; ``overrides`` are its keyword arguments."""
        return cls("smp_lm", **{"seq_len": 64, **kwargs})

    @classmethod
    def hf(cls, model_type: str, overrides: Mapping[str, Any], **kwargs: Any) -> Workload:
        """A transformers model of ``model_type`` (or of a local ``config.json``, or a folder holding one) with
        config ``overrides``; random weights, nothing downloaded. Its head is the config's ``architectures`` entry
        when it names one, else the task the model type is made for (:func:`~shardkit.plan.hf_tasks.task_of`),
        unless ``task=`` is given."""
        return cls("hf", model_type, dict(overrides), **kwargs)

    @property
    def vocab_size(self) -> int:
        if self.kind in ("bench_lm", "demo_lm"):
            return self._lm_config().vocab_size
        if self.kind == "hf":
            return int(getattr(self.hf_config(), "vocab_size", 2))
        if self.kind == "smp_lm":
            return int(self.overrides.get("vocab", SMPLMConfig.vocab))
        return 2  # token ids 0 and 1 are valid for any factory model's embedding

    def _lm_config(self) -> Any:
        base = LMConfig.bench() if self.kind == "bench_lm" else LMConfig.demo()
        return LMConfig(**{**base.__dict__, "seq_len": self.seq_len, **self.overrides})

    def hf_config(self) -> Any:
        """The transformers config (``AutoConfig.for_model``, or a local config file read without downloading)
        with the overrides applied."""
        from transformers import AutoConfig

        try:
            if Path(self.name).exists():
                config = AutoConfig.from_pretrained(self.name, local_files_only=True)
            else:
                config = AutoConfig.for_model(self.name)
        except (ValueError, OSError) as exc:
            raise ValueError(
                f"{self.name!r} is neither a transformers model type nor a readable config.json (or folder holding "
                f"one): {exc}"
            ) from None
        for key, value in self.overrides.items():
            if not hasattr(config, key):
                raise ValueError(f"transformers {self.name} config has no field {key!r}")
            setattr(config, key, value)
        config.use_cache = False
        return config

    def build(self) -> nn.Module:
        """The unwrapped model (on the current default device: the planner opens ``torch.device("meta")``), its
        blocks checkpointed when :attr:`activation_checkpointing` is set."""
        model = self._build_model()
        if self.activation_checkpointing:
            # start-up cost: shardkit.nn (torch._dynamo) only when activation checkpointing is asked for
            from shardkit.nn.checkpoint.apply import apply_activation_checkpointing

            classes = tuple(block_classes(model))
            if not classes:
                raise ValueError("activation checkpointing needs blocks in an nn.ModuleList to wrap")
            apply_activation_checkpointing(model, classes, offload_to_cpu=self.offload_activations)
        return model

    def _build_model(self) -> nn.Module:
        if self.kind in ("bench_lm", "demo_lm"):
            return TransformerLM(self._lm_config())
        if self.kind == "smp_lm":
            return smp_lm(**{"seq": self.seq_len, **self.overrides})
        if self.kind == "hf":
            return build_hf(self.hf_config(), self.task, self.attention)
        module_name, _, attr = self.name.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
        check_model_factory(factory, self.name, self.overrides)
        model = factory(**self.overrides)
        if not isinstance(model, nn.Module):
            raise TypeError(f"{self.name} returned {type(model).__name__}, not an nn.Module")
        return model

    def batch(self) -> Any:
        """One rank's batch: ``(tokens,)`` for the LMs, the model's keyword inputs for transformers models
        (:func:`~shardkit.plan.hf_tasks.hf_batch`)."""
        if self.kind == "hf":
            return hf_batch(self.hf_config(), self.task, self.batch_size, self.seq_len)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len), generator=gen)
        return (tokens,)

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        """The task's training loss: next-token cross-entropy for causal LMs (and the bench and demo LMs), the
        cross-entropy of every position for masked and sequence-to-sequence LMs, of the class for classifiers."""
        if self.kind == "hf" and self.task != "causal_lm":
            return hf_loss(self.task, output, batch)
        return next_token_cross_entropy(output, batch)


def next_token_cross_entropy(output: Any, batch: Any) -> torch.Tensor:
    """Mean next-token cross-entropy of the logits (the output, or its ``.logits``) against the batch's tokens (its
    ``input_ids``, or its first element) shifted by one."""
    logits = output if isinstance(output, torch.Tensor) else output.logits
    tokens = batch["input_ids"] if isinstance(batch, Mapping) else batch[0]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def check_model_factory(factory: Callable[..., Any], name: str, overrides: Mapping[str, Any]) -> None:
    """Raise a PlanError unless ``factory`` accepts the call the planner makes: ``factory(**overrides)``.

    Checked against its signature before it is called, so a function that needs arguments (``math:sqrt``) is
    refused with what the planner calls and what it must look like, not with the function's own complaint."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have none to read: the call itself will tell
        return
    try:
        signature.bind(**overrides)
    except TypeError as exc:
        called = f"the keyword arguments {dict(overrides)}" if overrides else "no arguments"
        raise PlanError(
            f"model: the factory {name} is called with {called} and must return the torch.nn.Module to plan, e.g. "
            f"def build() -> torch.nn.Module (parameters need defaults); {name}{signature} cannot be called that "
            f"way ({exc})"
        ) from None


__all__ = ["KINDS", "Workload", "check_model_factory", "next_token_cross_entropy"]
