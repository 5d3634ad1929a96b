"""Compatibility path: the reference models moved to :mod:`shardkit.models`; this module re-exports them."""

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
