"""fairscale's ``gossip.utils.cuda_metering`` path."""

from shardkit.nn.slowmo.helpers import CudaEventRecorder

__all__ = ["CudaEventRecorder"]
