"""fairscale's ``nn.model_parallel`` names with fairscale's meanings: the groups of ``initialize_model_parallel``
(pipeline too), the four region mappings in forward and backward, and the ``utils`` helpers."""

from __future__ import annotations

import pytest
import torch

import shardkit.nn.model_parallel as mp
from shardkit.nn.model_parallel.utils import VocabUtility, divide_and_check_no_remainder, split_tensor_along_last_dim
from shardkit.testing import run_distributed


def test_utils_split_and_vocabulary_ranges() -> None:
    chunks = split_tensor_along_last_dim(torch.arange(12.0).view(2, 6), 3, contiguous_split_chunks=True)
    assert [c.tolist() for c in chunks][1] == [[2.0, 3.0], [8.0, 9.0]] and all(c.is_contiguous() for c in chunks)
    assert VocabUtility.vocab_range_from_global_vocab_size(100, 3, 4) == (75, 100)
    assert divide_and_check_no_remainder(12, 4) == 3
    with pytest.raises(ValueError, match="12 is not divisible by 5"):
        divide_and_check_no_remainder(12, 5)


def _groups_and_mappings(rank: int, world_size: int) -> dict[str, object]:
    mp.initialize_model_parallel(1, pipeline_length=2)
    groups = {
        "pipeline ranks": mp.get_pipeline_parallel_ranks(),
        "pipeline size": torch.distributed.get_world_size(mp.get_pipeline_parallel_group()),
        "model size with pipeline": mp.get_model_parallel_world_size(),
        "data size with pipeline": mp.get_data_parallel_world_size(),
    }
    mp.destroy_model_parallel()
    assert not mp.model_parallel_is_initialized()
    mp.initialize_model_parallel(8)  # fairscale clamps the size to the world
    r = mp.get_model_parallel_rank()
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]]) * (r + 1)  # different on each rank
    weights = torch.arange(1.0, 9.0).view(2, 4)  # the upstream gradient, its first columns for narrower outputs

    def grad_of(fn: object) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = x.clone().requires_grad_()
        out = fn(leaf)  # type: ignore[operator]
        (out * weights[:, : out.shape[-1]]).sum().backward()
        assert leaf.grad is not None
        return out.detach(), leaf.grad

    return {
        **groups,
        "model size": mp.get_model_parallel_world_size(),
        "context size": mp.get_context_parallel_world_size(),
        "copy": grad_of(mp.copy_to_model_parallel_region),
        "reduce": grad_of(mp.reduce_from_model_parallel_region),
        "scatter": grad_of(mp.scatter_to_model_parallel_region),
        "gather": grad_of(mp.gather_from_model_parallel_region),
    }


def test_groups_and_region_mappings_have_fairscale_s_meaning() -> None:
    for rank, got in enumerate(run_distributed(_groups_and_mappings, 2)):
        assert got["pipeline ranks"] == [0, 1] and got["pipeline size"] == 2
        assert got["model size with pipeline"] == 1 and got["data size with pipeline"] == 1
        assert got["model size"] == 2 and got["context size"] == 1
        x = torch.tensor([[1.0, 2.0], [3.0, 4.0]]) * (rank + 1)
        w = torch.arange(1.0, 9.0).view(2, 4)
        out, grad = got["copy"]
        assert torch.equal(out, x) and torch.equal(grad, 2 * w[:, :2])  # identity; gradients summed over 2 ranks
        out, grad = got["reduce"]
        assert torch.equal(out, x / (rank + 1) * 3) and torch.equal(grad, w[:, :2])  # summed; identity backward
        out, grad = got["scatter"]
        assert torch.equal(out, x[:, rank : rank + 1])  # this rank's column; backward gathers both ranks' grads
        assert torch.equal(grad, w[:, :1].repeat(1, 2))
        out, grad = got["gather"]
        assert torch.equal(out, torch.cat([x / (rank + 1), x / (rank + 1) * 2], dim=1))
        assert torch.equal(grad, w[:, 2 * rank : 2 * rank + 2])  # backward keeps this rank's columns
