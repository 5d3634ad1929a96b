"""What the FSDP, smp and SlowMo checkpoint sources say each rank holds, checked against the model itself.

After two training steps every rank lists its held tensors with their spans. Put together over the ranks, the
spans must cover every element of every tensor of the unwrapped model, the replicas' writing shares
(``replica_share``) must cover each element exactly once, and the values must be the single-process run's (for
SlowMo, the average the source computes into copies). The optimizer each source names must step exactly held
tensors, with momentum shaped like them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from any_to_any_lib import TWO_NODES, build, reference, release, train

from shardkit.checkpoint.adapters.fsdp import FSDPSource
from shardkit.checkpoint.adapters.slowmo import SlowMoSource
from shardkit.checkpoint.adapters.smp import SMPSource
from shardkit.checkpoint.universal.placement import replica_share
from shardkit.testing import run_distributed

SOURCES = {
    "fsdp_nested": FSDPSource,
    "fsdp_noflat": FSDPSource,
    "fsdp_hybrid": FSDPSource,
    "smp": SMPSource,
    "slowmo": SlowMoSource,
}


def _listing(rank: int, world_size: int, family: str) -> dict[str, Any]:
    run = build(family, rank, world_size, seed=0)
    train(run, range(2))
    source = SOURCES[family](run.model, run.optimizer)
    source.before_save()
    held = source.held()
    optimizer = source.local_optimizer()
    held_ids = {id(h.tensor) for h in held}
    stepped = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    pieces = []
    for h in held:
        flat = h.tensor.detach().reshape(-1).double()
        for s in h.spans:
            values = flat[s.local_offset : s.local_offset + s.stop - s.start].numpy().copy()
            pieces.append((s.fqn, tuple(s.shape), s.start, s.stop, h.replica_rank, h.replica_count, values))
    out = {
        "pieces": pieces,
        "aliases": source.aliases(),
        "optimizer_on_held": all(id(p) in held_ids for p in stepped) and bool(stepped),
        "momentum_shapes_fit": all(
            optimizer.state[p]["momentum_buffer"].shape == p.shape for p in stepped if p in optimizer.state
        ),
    }
    source.after_save()
    release(run)
    return out


@pytest.mark.parametrize(
    ("family", "world_size"),
    [("fsdp_nested", 4), ("fsdp_noflat", 2), ("fsdp_hybrid", 4), ("smp", 4), ("smp", 2), ("slowmo", 4)],
)
def test_held_spans_cover_the_model_once_with_its_values(family: str, world_size: int) -> None:
    expected = reference(2)
    env = TWO_NODES if family == "fsdp_hybrid" else None
    results = run_distributed(_listing, world_size, family, timeout_s=120, rank_env=env)
    covered: dict[str, torch.Tensor] = {k: torch.zeros(v.numel(), dtype=torch.int64) for k, v in expected.items()}
    written: dict[str, torch.Tensor] = {k: torch.zeros(v.numel(), dtype=torch.int64) for k, v in expected.items()}
    boxes_written: set[tuple[str, int, int]] = set()
    for rank, result in enumerate(results):
        assert result["optimizer_on_held"] and result["momentum_shapes_fit"], f"rank {rank}"
        assert result["aliases"] == {}
        if family == "fsdp_hybrid":  # two nodes hold the same shards: each writes half of them
            assert {piece[5] for piece in result["pieces"] if piece[0].startswith("0.")} == {2}
        for fqn, shape, start, stop, replica_rank, replica_count, values in result["pieces"]:
            want = expected[fqn]
            assert shape == tuple(want.shape), fqn
            got = torch.from_numpy(values)
            assert torch.allclose(got, want.reshape(-1)[start:stop], rtol=1e-5, atol=1e-6), f"rank {rank}: {fqn}"
            covered[fqn][start:stop] += 1
            lo, hi = replica_share(stop - start, replica_rank, replica_count)
            if (fqn, start + lo, start + hi) not in boxes_written:  # DCP keeps one copy of a box several ranks write
                boxes_written.add((fqn, start + lo, start + hi))
                written[fqn][start + lo : start + hi] += 1
    for fqn in expected:
        assert bool((covered[fqn] > 0).all()), f"{fqn}: some elements are held by no rank"
        assert bool((written[fqn] == 1).all()), f"{fqn}: elements written {written[fqn].tolist()} times"
