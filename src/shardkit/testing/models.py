"""Test-facing name for the reference models, which live in :mod:`shardkit.models`; this module re-exports them."""

from shardkit.models.reference import (
    BatchNormNet,
    Block,
    LMConfig,
    MixtureOfExperts,
    ModuleFn,
    NestedWrappedModule,
    TransformerLM,
    build,
    dense_batch,
    lm_batch,
    lm_flops_per_token,
    loss_for,
    make_batch,
    param_count,
)

__all__ = [
    "BatchNormNet",
    "Block",
    "LMConfig",
    "MixtureOfExperts",
    "ModuleFn",
    "NestedWrappedModule",
    "TransformerLM",
    "build",
    "dense_batch",
    "lm_batch",
    "lm_flops_per_token",
    "loss_for",
    "make_batch",
    "param_count",
]
