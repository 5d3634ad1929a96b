"""smp's config surface (issue 34, items 1 and 7): every key of smp v1.6-v1.15 and of AWS's scripts accepted with its
meaning, accepted with a logged note, or refused with a clear message; the rank helpers at pipeline 2 x tensor 2
and tensor 2 x reduced data 2; ``shard_optimizer_state`` under tensor parallelism; and bad input refused on every
rank before anything is built, also when only one rank's config is bad."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from smp_testlib import AWS_GPT2_CONFIG, split_linears_run

import shardkit.modelparallel as smp
from shardkit.modelparallel.config import ModelParallelConfig
from shardkit.modelparallel.config_notes import note_lines
from shardkit.testing import run_distributed

#: The smp config of AWS's GPT-J tensor-parallel script (train_gptj_smp_tensor_parallel_script.py) at its defaults:
#: the GPT-2 scripts' keys and a few more.
GPTJ_SCRIPT = {
    **{k: v for k, v in AWS_GPT2_CONFIG.items() if k not in ("sharded_data_parallel_degree", "bf16", "fp16")},
    "checkpoint_attentions": True,
    "prescaled_batch": True,
    "_match_weights": False,
    "fp16_params": False,
    "_fp32_grad_accumulation": False,
    "tensor_parallel_seed": 0,
    "ddp_port": None,
    "ddp_dist_backend": "auto",
}


def test_script_keys_are_accepted_and_noted_only_where_they_would_change_something(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = ModelParallelConfig.from_dict(GPTJ_SCRIPT)
    assert cfg.prescaled_batch and cfg.ddp
    lines = note_lines(cfg, backend="gloo")
    assert [line.split("=")[0] for line in lines] == ["_match_weights", "checkpoint_attentions"], lines
    assert "keep their original weights" in lines[0] and "smp.set_activation_checkpointing" in lines[1]
    neutral = {k: v for k, v in GPTJ_SCRIPT.items() if k not in ("_match_weights", "checkpoint_attentions")}
    assert note_lines(ModelParallelConfig.from_dict(neutral), backend="gloo") == []
    noted = ModelParallelConfig.from_dict(
        {"offload_activations": True, "ddp_dist_backend": "nccl", "fp16_params": True, "active_microbatches": 3}
    )
    text = "\n".join(note_lines(noted, backend="gloo"))
    assert "activations stay on the device" in text and "process group's own backend (gloo)" in text
    assert "smp.model_creation(dtype=torch.float16)" in text and "active_microbatches=3" in text
    # optimize: smp's default "memory" distributes layer norms under TP, shardkit's layers do not: said once.
    tp = ModelParallelConfig.from_dict({"tensor_parallel_degree": 2, "ddp": True})
    assert [line.split(":")[0] for line in note_lines(tp, "gloo")] == ["optimize='memory'"]
    assert note_lines(ModelParallelConfig.from_dict({"optimize": "memory"}), "gloo") == []
    # the older spelling of prescaled_batch in AWS's first GPT-2 script
    assert ModelParallelConfig.from_dict({"_prescaled_batch": True}).prescaled_batch
    smp.reset()
    with caplog.at_level(logging.WARNING, logger="shardkit.modelparallel"):
        smp.init({"offload_activations": True})
    smp.reset()
    assert [r.getMessage().count("offload_activations=True") for r in caplog.records] == [1]


@pytest.mark.parametrize(
    ("values", "error", "match"),
    [
        ({"predefined_hooks": False}, ValueError, "predefined_hooks=False: Hugging Face models .* always split"),
        ({"ddp_dist_backend": "mpi"}, ValueError, "'ddp_dist_backend' .* must be one of 'auto', 'nccl', 'gloo'"),
        ({"tensor_parallel_degre": 2}, ValueError, "not an smp config key \\(did you mean 'tensor_parallel_degree'"),
        ({"tensor_parallel_degree": "two"}, ValueError, "'tensor_parallel_degree' .* must be an int, got 'two'"),
        ({"tensor_parallel_degree": 2.0}, TypeError, "'tensor_parallel_degree' must be an int, got 2.0"),
        ({"prescaled_batch": 1}, TypeError, "'prescaled_batch' must be True or False, got 1"),
        ({"tensor_parallel_seed": "x"}, ValueError, "'tensor_parallel_seed' .* must be an int"),
        ({"active_microbatches": 0}, ValueError, "'active_microbatches' .* must be >= 1, got 0"),
        ({"placement_strategy": "DPX"}, ValueError, "'placement_strategy' must be one of 'cluster', 'spread', 'DPT'"),
        ({"optimize": "fast"}, ValueError, "'optimize' must be one of 'speed', 'memory'"),
        ({"prescaled_batch": True, "_prescaled_batch": False}, ValueError, "older name of prescaled_batch"),
        ({"tensor_parallel_degree": 2}, ValueError, "tensor_parallel_degree=2 needs 'ddp': True"),
    ],
)
def test_bad_keys_values_and_types_are_refused_with_what_to_do(
    values: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ModelParallelConfig.from_dict(values)


def test_prescaled_batch_without_tensor_parallelism_changes_nothing(single: None) -> None:
    # smp: with prescaled_batch the ranks of one TP group share a batch (shard by rdp_*); at degree 1 the group is
    # the rank itself, so rdp_* = dp_* and both ways of sharding give the same batches.
    smp.reset()
    smp.init({"prescaled_batch": True})
    try:
        assert (smp.rdp_rank(), smp.rdp_size(), smp.tp_size()) == (smp.dp_rank(), smp.dp_size(), 1)
    finally:
        smp.reset()


# ---- multi-process: the helpers and shard_optimizer_state at pp 2 x tp 2 and tp 2 x rdp 2 ---------------------------


def _helpers() -> dict[str, Any]:
    names = ["rank", "tp_rank", "tp_size", "pp_rank", "pp_size", "rdp_rank", "rdp_size", "dp_rank", "dp_size"]
    got: dict[str, Any] = {name: getattr(smp, name)() for name in [*names, "mp_rank", "mp_size"]}
    for name in ["get_tp_group", "get_pp_group", "get_rdp_group", "get_dp_group", "get_mp_group"]:
        got[name] = getattr(smp, name)()
    for kind in ["WORLD", "MP", "DP", "PP", "RDP", "TP"]:
        group = getattr(smp.CommGroup, kind if kind == "WORLD" else f"{kind}_GROUP")
        got[f"{kind}_GROUP"] = smp.allgather(smp.rank(), group)
    groups = {
        "world": smp.get_world_process_group(),
        "mp": smp.get_mp_process_group(),
        "dp": smp.get_dp_process_group(),
        "pp": smp.get_pp_process_group(),
        "rdp": smp.get_rdp_process_group(),
        "tp": smp.get_tp_process_group(),
    }
    for kind, group in groups.items():  # real groups: a sum over each names its members
        total = torch.tensor([float(smp.rank())])
        dist.all_reduce(total, group=group)
        got[f"{kind}_sum"] = int(total.item())
    other = 1 - smp.tp_rank()  # the other tensor-parallel rank, addressed as smp's RankType.TP_RANK
    if smp.tp_rank() == 0:  # blocking sends: one side sends first
        smp.send(smp.rank(), other, smp.RankType.TP_RANK)
    got["from_tp_peer"] = smp.recv_from(other, smp.RankType.TP_RANK)
    if smp.tp_rank() == 1:
        smp.send(smp.rank(), other, smp.RankType.TP_RANK)
    return got


def _train(config: dict[str, Any], shard_by_rdp: bool) -> dict[str, Any]:
    """The helpers, then Adam on split linears for 3 steps beside plain torch on the whole batch."""
    smp.init(config)
    try:
        return {**_helpers(), **split_linears_run(torch.optim.Adam, 0.05, shard_by_rdp)}
    finally:
        smp.reset()


def _layouts(rank: int, world_size: int) -> dict[str, Any]:
    common = {"tensor_parallel_degree": 2, "ddp": True, "shard_optimizer_state": True}
    pp_tp = _train({**common, "partitions": 2, "microbatches": 2, "prescaled_batch": True}, shard_by_rdp=True)
    tp_rdp = _train({**common, "prescaled_batch": False}, shard_by_rdp=False)
    return {"pp_tp": pp_tp, "tp_rdp": tp_rdp}


def test_helpers_and_sharded_optimizer_state_at_pp2_x_tp2_and_tp2_x_rdp2() -> None:
    results = run_distributed(_layouts, 4, timeout_s=150)
    for rank, result in enumerate(results):
        pp, tp = divmod(rank, 2)  # "cluster" = "DPT": tensor fastest, then pipeline
        got = result["pp_tp"]
        assert [got[k] for k in ("tp_rank", "tp_size", "pp_rank", "pp_size", "rdp_rank", "rdp_size")] == [
            tp, 2, pp, 2, 0, 1
        ]  # fmt: skip
        # smp's dp group holds the stage's ranks, tensor-parallel ranks included; mp = pipeline x tensor
        assert [got[k] for k in ("dp_rank", "dp_size", "mp_rank", "mp_size")] == [tp, 2, rank, 4]
        assert got["get_tp_group"] == got["TP_GROUP"] == got["get_dp_group"] == got["DP_GROUP"] == [2 * pp, 2 * pp + 1]
        assert got["get_pp_group"] == got["PP_GROUP"] == [tp, tp + 2]
        assert got["get_rdp_group"] == got["RDP_GROUP"] == [rank]
        assert got["get_mp_group"] == got["MP_GROUP"] == got["WORLD_GROUP"] == [0, 1, 2, 3]
        sums = {"world": 6, "mp": 6, "dp": 4 * pp + 1, "pp": 2 * tp + 2, "rdp": rank, "tp": 4 * pp + 1}
        assert {k: got[f"{k}_sum"] for k in sums} == sums
        assert got["from_tp_peer"] == rank ^ 1
        rdp, tp = divmod(rank, 2)
        got = result["tp_rdp"]
        assert [got[k] for k in ("tp_rank", "rdp_rank", "rdp_size", "dp_rank", "dp_size", "mp_rank", "mp_size")] == [
            tp, rdp, 2, rank, 4, tp, 2
        ]  # fmt: skip
        assert got["get_tp_group"] == got["MP_GROUP"] == [2 * rdp, 2 * rdp + 1]
        assert got["get_rdp_group"] == got["RDP_GROUP"] == [tp, tp + 2] and got["get_pp_group"] == [rank]
        assert got["DP_GROUP"] == [0, 1, 2, 3] and got["from_tp_peer"] == rank ^ 1
        for layout in ("pp_tp", "tp_rdp"):  # the optimizer state sharded over the ranks holding the same slices
            run = result[layout]
            for ranks_losses, theirs in zip(run["losses"], run["theirs"]):
                assert abs(sum(ranks_losses) / len(ranks_losses) - theirs) < 1e-5, (layout, run)


# ---- multi-process: bad input fails on every rank, before anything is built ----------------------------------------


def _refused(config: dict[str, Any]) -> str:
    try:
        smp.init(config)
    except (TypeError, ValueError) as exc:
        assert not smp.is_initialized()
        return f"{type(exc).__name__}: {exc}"
    smp.reset()
    return "accepted"


def _bad_input(rank: int, world_size: int) -> dict[str, Any]:
    good = {"tensor_parallel_degree": 2, "ddp": True}
    out = {
        "one_rank_unknown": _refused(good if rank == 0 else {**good, "microbatch": 2}),
        "one_rank_type": _refused(good if rank == 1 else {**good, "tensor_parallel_degree": 2.5}),
        "no_ddp": _refused({"tensor_parallel_degree": 2}),
        "product": _refused({"tensor_parallel_degree": 2, "partitions": 2, "ddp": True}),
        "placement": _refused({**good, "placement_strategy": "TDX"}),
    }
    smp.init(good)  # nothing was half-built: the groups of a valid config come up after all that
    try:
        for name, build in {
            "heads": lambda: smp.nn.DistributedAttentionLayer(
                num_attention_heads=3, attention_head_size=4, hidden_size=12
            ),
            "hidden": lambda: smp.nn.DistributedLinear(3, 4),
        }.items():
            try:
                build()
                out[name] = "accepted"
            except ValueError as exc:
                out[name] = str(exc)
        out["tp_sum"] = smp.allgather(rank, smp.TP_GROUP)
    finally:
        smp.reset()
    return out


def test_bad_input_is_refused_on_every_rank_before_anything_is_built() -> None:
    results = run_distributed(_bad_input, 2, timeout_s=120)
    first, second = results
    assert "'microbatch': not an smp config key (did you mean 'microbatches'?)" in second["one_rank_unknown"]
    assert first["one_rank_unknown"].startswith("ValueError: smp.init failed on rank(s) 1")
    assert "did you mean 'microbatches'" in first["one_rank_unknown"]
    assert first["one_rank_type"].startswith("TypeError: smp config 'tensor_parallel_degree' must be an int, got 2.5")
    assert second["one_rank_type"].startswith("ValueError: smp.init failed on rank(s) 0")
    for result in results:
        assert "tensor_parallel_degree=2 needs 'ddp': True" in result["no_ddp"]
        assert "multiple of pipeline_parallel_degree (2) x tensor_parallel_degree (2) = 4" in result["product"]
        assert "'placement_strategy' must be one of" in result["placement"]
        assert "num_attention_heads=3 does not split across 2 tensor-parallel ranks" in result["heads"]
        assert "sizes that divide it: [1, 3]" in result["heads"] and "tensor_parallel_degree" in result["heads"]
        assert "in_features=3" in result["hidden"] and "sizes that divide it: [1, 3]" in result["hidden"]
        assert result["tp_sum"] == [0, 1]
