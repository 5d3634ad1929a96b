"""Bad input to the model-parallel API: a clear error, on every rank, before anything is changed."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from llama_mp import ModelArgs, Transformer

import shardkit.nn.model_parallel as mp
from shardkit import tensor_parallel as tp
from shardkit.testing import run_distributed


@pytest.mark.parametrize(
    "call",
    [
        mp.get_model_parallel_group,
        mp.get_model_parallel_rank,
        mp.get_data_parallel_world_size,
        lambda: mp.ColumnParallelLinear(4, 4),
        lambda: mp.copy_to_model_parallel_region(torch.ones(2)),
        lambda: mp.model_parallel_cuda_manual_seed(1),
    ],
)
def test_the_api_before_initialize_model_parallel_says_to_call_it(call: Callable[[], object]) -> None:
    assert not mp.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match=r"initialize_model_parallel\(model_parallel_size\)"):
        call()


def test_a_world_that_is_not_data_x_pipeline_x_tensor_names_the_sizes_that_fit() -> None:
    with pytest.raises(ValueError, match=r"world size 6 .* tensor 4 .* sizes that fit are \[1, 2, 3, 6\]"):
        tp.ParallelLayout.for_world(6, tensor=4)
    with pytest.raises(ValueError, match=r"pipeline 2 .* sizes that fit are \[1, 3\]"):
        tp.ParallelLayout.for_world(6, tensor=2, pipeline=2)


def test_the_layout_puts_tensor_parallel_ranks_next_to_each_other_as_fairscale_does() -> None:
    layout = tp.ParallelLayout.for_world(16, tensor=2, pipeline=2)
    assert layout.shape == (4, 2, 1, 2)
    assert layout.group_ranks("tensor", 5) == [4, 5]
    assert layout.group_ranks("pipeline", 5) == [5, 7]
    assert layout.group_ranks("data", 5) == [1, 5, 9, 13]
    assert all(layout.rank_of(layout.coords(r)) == r for r in range(16))


def test_a_strided_split_interleaves_the_fused_parts_and_round_trips() -> None:
    full = torch.arange(12.0).view(12, 1)
    spec = tp.ShardSpec(0, stride=2)
    shards = [spec.shard(full, r, 2) for r in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 2, 6, 7, 8]
    assert torch.equal(spec.unshard(shards), full)


def _errors_on_every_rank(rank: int, world_size: int, directory: str) -> dict[str, str]:
    messages: dict[str, str] = {}

    def expect(name: str, call: Callable[[], object], error: type[Exception] = ValueError) -> None:
        try:
            call()
        except error as err:
            messages[name] = str(err)

    expect("layout", lambda: mp.initialize_model_parallel(2, pipeline_length=2))
    messages["initialized after a bad layout"] = str(mp.model_parallel_is_initialized())
    mp.initialize_model_parallel(2)
    expect("twice", lambda: mp.initialize_model_parallel(2), RuntimeError)
    expect("column", lambda: mp.ColumnParallelLinear(8, 5))
    expect("row", lambda: mp.RowParallelLinear(7, 4))
    expect("vocab", lambda: mp.VocabParallelEmbedding(9, 4))
    expect("heads", lambda: Transformer(ModelArgs(n_kv_heads=1)))

    model = Transformer(ModelArgs())
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(0.5)  # Llama's init_method leaves the allocation as it is (possibly NaN)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 0:
        specs = tp.tp_sharding(model)
        full = {k: torch.randn(_full_shape(v, specs.get(k), 2)) for k, v in before.items()}
        two = tp.split_state_dict(full, specs, 2)
        tp.save_shard_files(f"{directory}/two", two)
        tp.save_shard_files(f"{directory}/three", [two[0]] * 3)
        tp.save_shard_files(f"{directory}/four", tp.split_state_dict(full, specs, 4))
        other = tp.split_state_dict({k: v + 1 for k, v in full.items()}, specs, 2)
        tp.save_shard_files(f"{directory}/mixed", [two[0], other[1]])  # rank 1's file from another checkpoint
    dist.barrier()
    expect("degree", lambda: tp.load_shard_file(model, f"{directory}/three"))
    expect("rank", lambda: tp.load_shard_file(model, f"{directory}/two/consolidated.01.pth"))
    expect("cut for 4", lambda: tp.load_shard_file(model, f"{directory}/four/consolidated.0{rank}.pth"))
    expect("mixed", lambda: tp.load_shard_file(model, f"{directory}/mixed"))
    tokens = torch.arange(6).view(1, 6) + rank  # a loader sharded by the global rank: the TP ranks differ
    expect("inputs", lambda: model(tokens))
    messages["unchanged"] = str(all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()))
    return messages


def _full_shape(local: torch.Tensor, spec: object, degree: int) -> tuple[int, ...]:
    shape = list(local.shape)
    if isinstance(spec, tp.ShardSpec):
        shape[spec.dim] *= degree
    return tuple(shape)


def test_bad_sizes_layouts_and_shard_files_raise_on_every_rank_naming_what_fits(tmp_path: Path) -> None:
    for rank, messages in enumerate(run_distributed(_errors_on_every_rank, 2, str(tmp_path))):
        assert "tensor 2 x pipeline 2" in messages["layout"] and "[1]" in messages["layout"], messages
        assert messages["initialized after a bad layout"] == "False"
        assert "already initialized" in messages["twice"]
        assert "out_features=5" in messages["column"] and "sizes that divide it: [1, 5]" in messages["column"]
        assert "in_features=7" in messages["row"] and "[1, 7]" in messages["row"]
        assert "num_embeddings=9" in messages["vocab"] and "[1, 3, 9]" in messages["vocab"]
        assert "Attention: n_kv_heads=1" in messages["heads"] and "[1]" in messages["heads"]
        assert "holds 3 shard files" in messages["degree"] and "initialize_model_parallel(3)" in messages["degree"]
        # only rank 0 was given another rank's file, and both ranks refuse
        assert "rank 0: consolidated.01.pth is the shard of model-parallel rank 1" in messages["rank"], rank
        assert "cut for model-parallel size 4" in messages["cut for 4"], messages["cut for 4"]
        assert "rank 1's file and rank 0's hold different values of the replicated" in messages["mixed"]
        assert "layers.0.attention_norm.weight" in messages["mixed"], messages["mixed"]
        assert messages["inputs"].startswith("ParallelEmbedding(num_embeddings=64, embedding_dim=32"), messages
        assert "ranks 0 and 1 of this group got different inputs" in messages["inputs"]
        assert "get_data_parallel_rank()" in messages["inputs"]
        assert messages["unchanged"] == "True"
