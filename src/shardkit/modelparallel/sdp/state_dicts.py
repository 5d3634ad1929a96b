"""The model's state dicts under sharded data parallelism.

- Full (``model.state_dict()``, ``smp.save_checkpoint(partial=False)``): the sharding group gathers the shards into
  the plain module's state dict (tensor-parallel slices then merged as without sharding): a plain model of the same
  class loads it, and so does this model at any sharding degree.
- Partial (``model.local_state_dict()``, ``smp.save_checkpoint(partial=True)``): this rank's shards and buffers,
  marked partial; it loads back only at the same layout (same degrees), bit for bit.

A state dict given before the first step (``smp.resume_from_checkpoint`` right after building the model) waits for
the partition, when the shards exist.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardkit.modelparallel.checkpoints import checkpoint as ckpt
from shardkit.modelparallel.sdp.wrap import ShardedStage


def full_state_dict(stage: ShardedStage) -> dict[str, Any]:
    """The whole stage's state dict under the plain module's keys (collective over the sharding group)."""
    return dict(stage.root.state_dict())


def local_state_dict(stage: ShardedStage) -> dict[str, Any]:
    """This rank's shards and buffers, marked partial (no communication)."""
    local = dict(stage.root.local_state_dict())
    local[ckpt.PARTIAL_KEY] = True
    local[_DEGREE_KEY] = stage.settings.degree
    return local


def load_into(stage: ShardedStage, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
    """Load a full state dict (collective over the sharding group) or this rank's partial one."""
    if not ckpt.is_partial(state_dict):
        return stage.root.load_state_dict(state_dict, strict=strict)
    degree = state_dict.get(_DEGREE_KEY)
    if degree != stage.settings.degree:
        raise ValueError(
            f"this partial state dict was saved with sharded_data_parallel_degree={degree} and this run has "
            f"{stage.settings.degree}: a partial checkpoint holds one rank's shards and loads only at the layout it "
            "was saved with; load it at that degree, or save and load a full checkpoint (partial=False)"
        )
    shards = {k: v for k, v in state_dict.items() if k not in (ckpt.PARTIAL_KEY, _DEGREE_KEY)}
    return stage.root.load_local_state_dict(shards, strict=strict)


#: The sharding degree a partial state dict was saved at (checked when it is loaded).
_DEGREE_KEY = "_smp_sdp_degree"
