"""Compatibility path for fairscale's ``gossip.utils.cuda_metering`` (see :mod:`shardkit.compat`)."""

from shardkit.nn.slowmo.helpers import CudaEventRecorder

__all__ = ["CudaEventRecorder"]
