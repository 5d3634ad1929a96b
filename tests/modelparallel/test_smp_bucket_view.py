"""gradient_as_bucket_view=True: gradients are views of the flat all-reduce buckets, results unchanged."""

from __future__ import annotations

from typing import Any

from smp_testlib import reference_run, smp_run

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit import max_state_diff

CONFIG = {"partitions": 1, "microbatches": 2, "ddp": True}
STEPS = 3


def _runs(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for overlap in (True, False):
        for as_view in (False, True):
            losses, state, model = smp_run(
                "mlp", CONFIG, STEPS, 8, gradient_as_bucket_view=as_view, overlapping_allreduce=overlap
            )
            grads = [p.grad for p in model.local_parameters()]
            storages = {g.untyped_storage().data_ptr() for g in grads if g is not None}
            out[f"{overlap}-{as_view}"] = {
                "losses": losses,
                "state": state,
                "storages": len(storages),
                "all_have_grads": all(g is not None for g in grads),
                "storage_bytes": grads[0].untyped_storage().nbytes() if grads[0] is not None else -1,
                "param_bytes": sum(p.numel() * p.element_size() for p in model.local_parameters()),
            }
            smp.reset()
    return out


def test_bucket_views_alias_one_storage_and_train_like_copies() -> None:
    ref_losses, ref_state = reference_run("mlp", STEPS, 8, replicas=2)
    for rank, out in enumerate(run_distributed(_runs, 2)):
        for overlap in (True, False):
            copies, views = out[f"{overlap}-False"], out[f"{overlap}-True"]
            # One bucket (25 MB cap): with views every gradient lives in it, and it is exactly their size.
            assert views["all_have_grads"] and views["storages"] == 1
            assert views["storage_bytes"] == views["param_bytes"]
            # Without views each gradient has its own storage.
            assert copies["storages"] == 8
            assert views["losses"] == copies["losses"]
            assert max_state_diff(views["state"], copies["state"]) == 0.0
            assert max(abs(a - r[rank]) for a, r in zip(views["losses"], ref_losses)) <= 1e-5
            assert max_state_diff(views["state"], ref_state) <= 1e-5
