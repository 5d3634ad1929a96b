"""A copy of a tensor-parallel smp model (``copy.deepcopy``, as scripts do for an EMA or a frozen reference) is a
tensor-parallel model too: it communicates over the same group and declares the same split parameters.

Before: ``copy.deepcopy`` raised "cannot pickle ProcessGroup" (the layers hold their group); with that fixed, the
copy's smp modules had not declared their children's slices to the core, so clipping and checkpoints would have
counted each rank's slice as a whole tensor.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from test_smp_universal_tp import Net, _config

import shardkit.modelparallel as smp
from shardkit.tensor_parallel import tp_sharding
from shardkit.testing import run_distributed


def _copy(rank: int, world_size: int) -> dict[str, Any]:
    smp.init(_config(2))
    try:
        torch.manual_seed(0)
        net = Net()
        twin = copy.deepcopy(net)
        x = torch.randint(0, 16, (2, 3), generator=torch.Generator().manual_seed(1))
        return {
            "original": {name: (spec.dim, spec.stride) for name, spec in tp_sharding(net).items()},
            "copy": {name: (spec.dim, spec.stride) for name, spec in tp_sharding(twin).items()},
            "same_output": torch.equal(net(x), twin(x)),  # runs the copy's collectives on the shared group
            "shares_group": twin.head.tp.group is net.head.tp.group,
        }
    finally:
        smp.reset()


def test_a_deep_copy_keeps_the_split_record_and_the_group() -> None:
    for rank, result in enumerate(run_distributed(_copy, 2)):
        assert result["copy"] == result["original"], rank
        assert {"emb.weight", "ffn.dense1.weight", "ffn.dense2.weight", "head.weight"} <= set(result["copy"]), rank
        assert result["same_output"] and result["shares_group"], rank
