"""Checkpoints in smp v1.10+'s layouts: ``<f>_<pp>_<tp>.pt`` files and ``smp.save_checkpoint`` folders.

The fixtures are written by our own code in the layout smp documents; loading them must give back exactly the
saved model (and continued training must match training that never stopped). Layouts this run cannot load (a
tensor-parallel shard, more stages than this run) and missing files are refused on every rank.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import pytest
import torch
from smp_testlib import batch, mlp, train_steps

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit import max_state_diff

CONFIG = {"partitions": 2, "microbatches": 2}


def _build(seed: int) -> tuple[smp.DistributedModel, Any]:
    smp.init(CONFIG)
    torch.manual_seed(seed)
    module = mlp()
    if seed:  # a different start: only the checkpoint can make it match
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn_like(p))
    model = smp.DistributedModel(module)
    return model, smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))


def _train(model: smp.DistributedModel, opt: Any, steps: range) -> list[float]:
    return train_steps(model, opt, "mlp", 8, steps)


def _error_of(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:  # the test asserts on the type and text
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _v110_files(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    base = os.path.join(directory, "ckpt.pt")
    model, opt = _build(0)
    _train(model, opt, range(2))
    saved = model.state_dict()
    # smp v1.10+'s partial layout, written by our code: <f>_<pp_rank>_<tp_rank>.pt
    torch.save({"model": model.local_state_dict(), "opt": opt.local_state_dict()}, f"{base}_{smp.pp_rank()}_0.pt")
    continued = _train(model, opt, range(2, 4))
    smp.barrier()
    smp.reset()

    out: dict[str, Any] = {}
    model, opt = _build(1)
    model.load_state_dict(smp.load(base, partial=True)["model"])
    _partition(model)
    out["loaded_vs_saved"] = max_state_diff(model.state_dict(), saved)
    smp.reset()

    model, opt = _build(1)
    checkpoint = smp.load(base, partial=True)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    resumed = _train(model, opt, range(2, 4))
    out["loss_diff"] = max(abs(a - b) for a, b in zip(resumed, continued))
    smp.reset()

    smp.init(CONFIG)
    if smp.pp_rank() == 1:  # the checkpoint's stage 1 also had a tensor-parallel shard 1
        torch.save({}, f"{base}_1_1.pt")
    smp.barrier()
    out["tensor_parallel"] = _error_of(lambda: smp.load(base, partial=True))
    smp.barrier()
    if rank == 0:
        os.remove(f"{base}_1_1.pt")
        torch.save({}, f"{base}_2_0.pt")  # a third stage: saved with more partitions than this run has
    smp.barrier()
    out["more_stages"] = _error_of(lambda: smp.load(base, partial=True))
    smp.barrier()
    if rank == 0:
        os.remove(f"{base}_2_0.pt")
        os.remove(f"{base}_1_0.pt")
    smp.barrier()
    out["missing"] = _error_of(lambda: smp.load(base, partial=True))
    smp.reset()
    return out


@smp.step
def _forward(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def _partition(model: smp.DistributedModel) -> None:
    with torch.no_grad():
        _forward(model, batch("mlp", 8, 0)[0])


def test_v110_partial_files_load_and_bad_layouts_are_refused_on_every_rank(tmp_path: Any) -> None:
    for rank, r in enumerate(run_distributed(_v110_files, 2, str(tmp_path))):
        assert r["loaded_vs_saved"] == 0.0, r
        assert r["loss_diff"] <= 1e-6, r
        assert r["tensor_parallel"].startswith("ValueError") and "tensor parallelism" in r["tensor_parallel"], r
        assert "rank 1:" in r["tensor_parallel"], r  # rank 0 raises too, naming the rank that found it
        assert r["more_stages"].startswith("ValueError") and "pipeline stage 2" in r["more_stages"], r
        assert r["missing"].startswith("FileNotFoundError") and "rank 1:" in r["missing"], (rank, r)
        assert "rank 0:" not in r["missing"], r


def _folders(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    model, opt = _build(0)
    _train(model, opt, range(2))
    smp.save_checkpoint(directory, "step2", model=model, optimizer=opt, user_content={"step": 2})
    _train(model, opt, range(2, 3))
    smp.save_checkpoint(directory, "step3", model=model, optimizer=opt, user_content={"step": 3})
    _train(model, opt, range(3, 4))
    smp.save_checkpoint(
        directory, "step4", model=model, optimizer=opt, user_content={"step": 4}, num_kept_partial_checkpoints=2
    )
    smp.save_checkpoint(
        directory, "full4", partial=False, model=model, optimizer=opt, user_content={"step": 4, "full": True}
    )
    smp.save_checkpoint(directory, "model_only", partial=False, model=model)
    saved = model.state_dict()
    continued = _train(model, opt, range(4, 6))
    out: dict[str, Any] = {"files": sorted(os.listdir(directory))}
    out["partial_files"] = sorted(os.listdir(os.path.join(directory, "step4_partial")))
    out["bad_user_content"] = _error_of(
        lambda: smp.save_checkpoint(directory, "bad", model=model, user_content={"f": _NotWeights()})
    )
    smp.reset()

    model, opt = _build(1)
    out["user_content"] = smp.resume_from_checkpoint(directory, tag="step4")
    resumed = _train(model, opt, range(4, 6))
    out["loss_diff"] = max(abs(a - b) for a, b in zip(resumed, continued))
    smp.reset()

    model, opt = _build(1)
    out["full_user_content"] = smp.resume_from_checkpoint(directory, tag="full4", partial=False)
    resumed_full = _train(model, opt, range(4, 6))
    out["full_loss_diff"] = max(abs(a - b) for a, b in zip(resumed_full, continued))
    smp.reset()

    model, opt = _build(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        smp.resume_from_checkpoint(directory, tag="model_only", partial=False)
    out["model_only_warning"] = [str(w.message) for w in caught if "no optimizer state" in str(w.message)]
    _partition(model)
    out["full_vs_saved"] = max_state_diff(model.state_dict(), saved)
    plain = mlp()
    plain.load_state_dict(torch.load(os.path.join(directory, "full4"), weights_only=True))
    out["plain_vs_saved"] = max_state_diff(plain.state_dict(), saved)
    smp.reset()

    # smp.load of a <tag>_partial folder, and of the checkpoint folder (its newest: the model-only full one)
    model, opt = _build(1)
    folder = smp.load(os.path.join(directory, "step4_partial"))
    model.load_state_dict(folder["model"])
    opt.load_state_dict(folder["optimizer"])
    out["folder_user_content"] = folder["user_content"]
    out["folder_loss_diff"] = max(abs(a - b) for a, b in zip(_train(model, opt, range(4, 6)), continued))
    smp.reset()
    model, opt = _build(1)
    newest = smp.load(directory, partial=False)
    model.load_state_dict(newest["model"])
    _partition(model)
    out["newest_vs_saved"] = max_state_diff(model.state_dict(), saved)
    out["newest_optimizer"] = newest["optimizer"]
    smp.reset()

    model, opt = _build(1)
    if rank == 0:
        os.remove(os.path.join(directory, "step4_partial", "optimizer_1_0.pt"))
    smp.barrier()
    out["missing"] = _error_of(lambda: smp.resume_from_checkpoint(directory, tag="step4"))
    out["newest_partial"] = _error_of(lambda: smp.resume_from_checkpoint(directory))
    with open(os.path.join(directory, "newest"), encoding="utf-8") as newest:
        out["newest"] = newest.read()
    smp.reset()
    return out


class _NotWeights:
    """An object weights-only loading refuses."""


def test_save_checkpoint_folders_resume_training_and_refuse_missing_files(tmp_path: Any) -> None:
    for r in run_distributed(_folders, 2, str(tmp_path)):
        assert r["files"] == [
            "full4",
            "model_only",
            "newest",
            "optimizer_full4",
            "step3_partial",
            "step4_partial",
            "user_content_full4",
            "user_content_model_only",
        ], r
        assert r["partial_files"] == [
            "model_0_0.pt",
            "model_1_0.pt",
            "optimizer_0_0.pt",
            "optimizer_1_0.pt",
            "user_content.pt",
        ]
        assert r["user_content"] == {"step": 4} and r["full_user_content"] == {"step": 4, "full": True}
        assert r["loss_diff"] <= 1e-6, r
        assert r["full_vs_saved"] == 0.0 and r["plain_vs_saved"] == 0.0, r
        assert r["full_loss_diff"] <= 1e-6, r  # the full checkpoint's optimizer state came back too
        assert len(r["model_only_warning"]) == 1, r
        assert r["folder_user_content"] == {"step": 4} and r["folder_loss_diff"] <= 1e-6, r
        assert r["newest_vs_saved"] == 0.0 and r["newest_optimizer"] is None, r
        assert r["bad_user_content"].startswith("TypeError") and "user_content" in r["bad_user_content"]
        assert r["newest"] == "model_only"
        assert r["missing"].startswith("FileNotFoundError") and "rank 1:" in r["missing"], r
        assert "optimizer_1_0.pt" in r["missing"] and "rank 0:" not in r["missing"], r
        # newest is a full checkpoint, so resuming a partial one from it finds no folder: every rank says so
        assert r["newest_partial"].startswith("FileNotFoundError") and "model_only_partial" in r["newest_partial"], r


def test_load_is_weights_only(tmp_path: Any) -> None:
    path = str(tmp_path / "pickled.pt")
    torch.save({"obj": _NotWeights()}, path)
    with pytest.raises(Exception, match="weights-only"):
        smp.load(path, partial=False)
