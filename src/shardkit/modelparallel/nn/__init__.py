"""``smp.nn``: layers that SageMaker's smp ships in place of Apex's (same arguments, plain torch inside).

Example::

    import shardkit.modelparallel as smp

    norm = smp.nn.FusedLayerNorm(1024)
"""

from shardkit.modelparallel.nn.fused_layer_norm import FusedLayerNorm

__all__ = ["FusedLayerNorm"]
