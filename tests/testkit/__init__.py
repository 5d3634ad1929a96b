"""Helpers shared by every test folder: batches, training loops, gradient averaging, comparisons, small models, and
the three test speeds (``speeds``).

``tests/`` is on ``sys.path`` under pytest (its ``conftest.py`` sits there and ``tests/`` is no package), so any test
or per-folder helper imports ``from testkit import ...``; the multi-process harness's workers inherit that path.
Strategies are built through the registry (``units_at``: chosen FSDP units). smp helpers live in ``testkit.smp``
(importing it imports ``shardkit.modelparallel``).
"""

from .compare import (
    assert_states_close,
    bitwise_difference,
    max_param_diff,
    max_state_diff,
    same_optimizer_state,
    state_difference,
)
from .data import Batch, data_parallel_rows, model_batch, rank_batch, regression_batch, unwrap
from .models import OPTIMIZERS, BranchyNet, tiny_model
from .strategies import units_at
from .train import average_grads, train_harness_model, train_step

__all__ = [
    "OPTIMIZERS",
    "Batch",
    "BranchyNet",
    "assert_states_close",
    "average_grads",
    "bitwise_difference",
    "data_parallel_rows",
    "max_param_diff",
    "max_state_diff",
    "model_batch",
    "rank_batch",
    "regression_batch",
    "same_optimizer_state",
    "state_difference",
    "tiny_model",
    "train_harness_model",
    "train_step",
    "units_at",
    "unwrap",
]
