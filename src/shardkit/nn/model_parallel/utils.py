"""fairscale's ``nn.model_parallel.utils``: divisibility checks, last-dimension splits, vocabulary ranges."""

from __future__ import annotations

import torch

from shardkit.tensor_parallel import divisors


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raise ``ValueError`` unless ``denominator`` divides ``numerator``."""
    if numerator % denominator:
        raise ValueError(
            f"{numerator} is not divisible by {denominator} (divisors of {numerator}: {divisors(numerator)})"
        )


def divide_and_check_no_remainder(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, refusing a remainder."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """``num_partitions`` equal views of ``tensor`` along its last dimension (copies when contiguous is asked)."""
    size = divide_and_check_no_remainder(tensor.shape[-1], num_partitions)
    chunks = torch.split(tensor, size, dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else tuple(chunks)


class VocabUtility:
    """The ``[first, last)`` vocabulary range each model-parallel rank holds."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """The range of ``rank`` when every rank holds ``per_partition_vocab_size`` ids."""
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
        """The range of ``rank`` for a vocabulary of ``global_vocab_size`` split over ``world_size`` ranks."""
        per_rank = divide_and_check_no_remainder(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_rank, rank, world_size)


__all__ = ["VocabUtility", "divide_and_check_no_remainder", "ensure_divisibility", "split_tensor_along_last_dim"]
