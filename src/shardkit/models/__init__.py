"""Reference models shared by the planner, the demo, the benchmarks and the tests.

They live here, below the tools that use them, rather than in :mod:`shardkit.testing` (which re-exports them
for tests and scripts that import ``shardkit.testing.models``). See :mod:`shardkit.models.reference`.
"""

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
