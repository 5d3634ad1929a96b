"""Sharded data parallelism clips by the whole model's norm under tensor parallelism, smp's own modules included.

smp's distributed modules (``DistributedEmbedding``, the transformer blocks) name slices of their children's
parameters; FSDP's clipping asks the tensor-parallel core which parameters are split. Unless the modules declare
their slices to the core, each tensor-parallel rank counts its own slice as a whole tensor: the ranks of one pair
get different norms, clip by different factors, and their replicated parameters (the layer norm) drift apart
without a word.
"""

from __future__ import annotations

from typing import Any

import torch
from test_smp_universal_tp import Net, _batch, _config, _train

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed

MAX_NORM = 0.05  # well below the norm, so clipping acts


def _norms(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sharded in (False, True):
        smp.init({**_config(2, sdp=2 if sharded else 1), "sdp_gradient_clipping": MAX_NORM})
        try:
            torch.manual_seed(0)
            model = smp.DistributedModel(Net())
            optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
            optimizer.zero_grad()
            _train(model, *_batch(0))
            if sharded:  # smp clips inside step() to sdp_gradient_clipping and keeps the norm it found
                optimizer.step()
                out["sdp"] = float(optimizer._global_grad_norm)
                out["norm_weight"] = model.state_dict()["norm.weight"].clone()
            else:  # plain reduced data parallelism: smp's clip_master_grads, which counts each slice once
                out["plain"] = float(optimizer.clip_master_grads(MAX_NORM))
        finally:
            smp.reset()
    return out


def test_tp2_x_sdp2_clips_every_rank_by_the_whole_models_norm() -> None:
    results = run_distributed(_norms, 4)
    plain = results[0]["plain"]
    for rank, r in enumerate(results):
        assert abs(r["plain"] - plain) < 1e-6 * plain, (rank, r["plain"], plain)
        assert abs(r["sdp"] - plain) < 1e-5 * plain, (rank, r["sdp"], plain)  # each slice counted once, every rank
        # the replicated norm weight, clipped by the same factor everywhere, is the same on every rank
        assert torch.equal(r["norm_weight"], results[0]["norm_weight"]), rank
