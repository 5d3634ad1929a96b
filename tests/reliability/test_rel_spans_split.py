"""A tensor-parallel slab in the universal layout: every box of it maps to the boxes of the full tensor it is (no
processes; the multi-process any-to-any test is ``test_rel_any_to_any_tp``)."""

from __future__ import annotations

import pytest
import torch

from shardkit.checkpoint.universal.placement import Placement
from shardkit.checkpoint.universal.source import Span
from shardkit.checkpoint.universal.split import Split
from shardkit.tensor_parallel import ShardSpec

#: (full shape, split dimension, stride, degree): every combination the layers accept (the dimension divides).
CASES = [
    (shape, dim, stride, size)
    for shape in ((12, 6), (6, 12), (2, 12, 3))
    for dim in (0, 1)
    for stride in (1, 3)
    for size in (2, 4)
    if shape[dim] % (size * stride) == 0
]


@pytest.mark.parametrize(("shape", "dim", "stride", "size"), CASES)
def test_every_box_of_a_slab_holds_the_full_tensors_elements_at_its_offsets(
    shape: tuple[int, ...], dim: int, stride: int, size: int
) -> None:
    full = torch.arange(float(torch.Size(shape).numel())).view(shape)
    for rank in range(size):
        split = Split(dim, rank, size, stride)
        slab = ShardSpec(dim, stride).shard(full, rank, size)
        assert tuple(split.local_shape(shape)) == tuple(slab.shape) and split.full_shape(slab.shape) == full.shape
        # the whole slab, and ranges inside it (as an FSDP flat shard of a tensor-parallel model holds)
        for lo, hi in ((0, slab.numel()), (1, slab.numel() - 1), (5, 11)):
            flat = slab.reshape(-1)[lo:hi].clone()
            placement = Placement("k", full.shape, full.dtype, lo, hi, flat, 0, split)
            covered = 0
            for box, view in placement.boxes():
                where = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))
                assert torch.equal(full[where], view), (rank, lo, hi, box)
                covered += view.numel()
            assert covered == hi - lo


def test_a_slab_is_written_as_boxes_of_the_full_shape_that_views_write_through() -> None:
    # a row-parallel weight: rank 1 of 2 holds columns 3..5 of a (4, 6) weight, one box
    slab = torch.zeros(4, 3)
    placement = Placement("k", torch.Size([4, 6]), slab.dtype, 0, 12, slab, 0, Split(1, 1, 2))
    [(box, view)] = placement.boxes()
    assert (box.offsets, box.sizes) == ((0, 3), (4, 3))
    view.fill_(1.0)  # a load writes through the view into the rank's own parameter
    assert slab.eq(1.0).all()


def test_a_span_of_a_slab_is_checked_against_the_slab_not_the_full_tensor() -> None:
    Span("w", torch.Size([4, 6]), 0, 12, split=Split(1, 0, 2))
    with pytest.raises(ValueError, match="outside its 12 elements"):
        Span("w", torch.Size([4, 6]), 0, 13, split=Split(1, 0, 2))


def test_sizes_that_do_not_split_name_the_parameter_the_sizes_and_the_degrees_that_do() -> None:
    with pytest.raises(ValueError) as err:
        Split(0, 0, 4).check("emb.weight", (18, 8))
    message = str(err.value)
    assert "'emb.weight'" in message and "size 18" in message and "4 tensor-parallel ranks" in message
    assert "[1, 2, 3, 6, 9, 18]" in message
    with pytest.raises(ValueError, match=r"stride 3; degrees that divide it: \[1, 2\]"):
        Split(0, 0, 4, stride=3).check("qkv.weight", (6, 8))
    with pytest.raises(ValueError, match="invalid tensor-parallel split"):
        Split(0, 2, 2)
