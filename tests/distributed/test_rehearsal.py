"""``local_rehearsal``: collectives complete locally with the shapes a real run gives, only inside the block and only
on the thread that opened it."""

import threading

import pytest
import torch

from shardkit.distributed import DummyProcessGroup
from shardkit.distributed import collectives as C
from shardkit.distributed.rehearsal import local_rehearsal, rehearsing


def test_collectives_complete_locally_with_real_shapes_inside_the_block_only() -> None:
    group = DummyProcessGroup(rank=1, size=4)  # describes 4 ranks: any real collective on it refuses
    shard = torch.arange(3.0)
    with local_rehearsal():
        total = shard.clone()
        C.all_reduce(total, group=group).wait()
        gathered = torch.empty(4, 3)
        C.all_gather_into_tensor(gathered, shard, group=group).wait()
        piece = torch.empty(3)
        C.reduce_scatter_tensor(piece, torch.arange(12.0), group=group).wait()
        C.broadcast(total, 0, group=group)
        C.barrier(group)
        on_meta = torch.empty(8, 3, device="meta")
        C.all_gather_into_tensor(on_meta, torch.empty(2, 3, device="meta"), group=group)  # nothing to send
        columns = torch.empty(3, 4).t()  # a non-contiguous output
        C.all_gather_into_tensor(columns, torch.arange(3.0), group=group)
        C.all_gather_into_tensor(torch.empty(0), torch.empty(0), group=group)  # empty shards too
    assert torch.equal(total, shard)  # left as it is
    assert torch.equal(gathered, shard.repeat(4, 1))  # this rank's shard in every member's place
    assert piece.shape == (3,) and on_meta.shape == (8, 3)
    assert torch.equal(columns, torch.arange(3.0).repeat(4).view(4, 3))
    assert not rehearsing()
    with pytest.raises(RuntimeError, match="only describes a sharding"):
        C.all_reduce(torch.ones(2), group=group)


def test_rehearsal_is_seen_by_the_opening_thread_only() -> None:
    seen: list[bool] = []
    with local_rehearsal():
        other = threading.Thread(target=lambda: seen.append(rehearsing()))
        other.start()
        other.join()
        seen.append(rehearsing())
    assert seen == [False, True]
