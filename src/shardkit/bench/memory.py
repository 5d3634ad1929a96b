"""Compatibility path: the memory meter moved to :mod:`shardkit.memory.meter`; this module re-exports it."""

from shardkit.memory.meter import MemoryBreakdown, format_bytes, optimizer_state_tensors, training_memory

__all__ = ["MemoryBreakdown", "format_bytes", "optimizer_state_tensors", "training_memory"]
