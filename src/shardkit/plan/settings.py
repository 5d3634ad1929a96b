"""The settings ``shardkit plan`` compares: one strategy with one set of options each, under a short label.

Kept apart from the command line so the report and plot modules can name them without importing the command.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Setting:
    """One strategy with one set of options, under a short label."""

    label: str
    strategy: str
    options: dict[str, Any]
    checkpointing: bool = False
    #: With ``checkpointing``: the checkpoints' saved inputs go to host memory (``offload_to_cpu=True``).
    offload_activations: bool = False
    #: Only planned with a node layout (``--nprocs-per-node``): hybrid sharding.
    needs_nodes: bool = False
    #: The batch is this many ranks' batches: a pipeline replica spans ``partitions`` ranks, so it takes their
    #: batches together (every setting then trains the same global batch).
    batch_ranks: int = 1


SETTINGS = (
    Setting("ddp", "ddp", {}),
    Setting("zero1 (oss_ddp)", "oss_ddp", {}),
    Setting("zero2 (oss_sdp)", "oss_sdp", {}),
    Setting("zero3 (fsdp, reshard)", "fsdp", {"reshard_after_forward": True}),
    Setting("zero3 (fsdp, no reshard)", "fsdp", {"reshard_after_forward": False}),
    Setting("zero3 (fsdp) + act. ckpt", "fsdp", {"reshard_after_forward": True}, checkpointing=True),
    Setting(
        "zero3 (fsdp, bf16 compute)",
        "fsdp",
        {"reshard_after_forward": True, "mixed_precision": True, "compute_dtype": torch.bfloat16},
    ),
    Setting(
        "zero3 (fsdp) + act. ckpt on cpu",
        "fsdp",
        {"reshard_after_forward": True},
        checkpointing=True,
        offload_activations=True,
    ),
    Setting("zero3 (fsdp) + cpu offload", "fsdp", {"reshard_after_forward": True, "cpu_offload": True}),
    Setting(
        "zero3 (fsdp) + offload + act. ckpt",
        "fsdp",
        {"reshard_after_forward": True, "cpu_offload": True},
        checkpointing=True,
    ),
    Setting("slowmo", "slowmo", {}),
    Setting("zero1 hybrid (oss_ddp)", "oss_ddp", {"hybrid": True}, needs_nodes=True),
    Setting("zero2 hybrid (oss_sdp)", "oss_sdp", {"hybrid": True}, needs_nodes=True),
    Setting("zero3 hybrid (fsdp)", "fsdp", {"sharding_strategy": "HYBRID_SHARD"}, needs_nodes=True),
    Setting(
        "zero3 hybrid (fsdp) + cpu offload",
        "fsdp",
        {"sharding_strategy": "HYBRID_SHARD", "cpu_offload": True},
        needs_nodes=True,
    ),
    Setting("pipeline (smp)", "smp", {}),  # expanded per world size by pipeline_settings
)
