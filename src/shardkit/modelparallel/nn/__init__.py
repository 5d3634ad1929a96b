"""``smp.nn``: layers that SageMaker's smp ships in place of Apex's (same arguments, plain torch inside).

``DistributedLinear`` and the transformer blocks (``DistributedTransformer``, ``DistributedTransformerLayer``,
``DistributedAttentionLayer``, ``DistributedTransformerOutputLayer``), ``DistributedEmbedding`` and
``DistributedTransformerLMHead`` are smp's tensor-parallel modules (see :mod:`shardkit.modelparallel.tp`).
``smp.nn.huggingface`` translates state dicts between Hugging Face's layouts and smp's.

Example::

    import shardkit.modelparallel as smp

    norm = smp.nn.FusedLayerNorm(1024)
"""

from shardkit.modelparallel.nn import huggingface
from shardkit.modelparallel.nn.fused_layer_norm import FusedLayerNorm
from shardkit.modelparallel.tp.embedding import DistributedEmbedding
from shardkit.modelparallel.tp.layers import DistributedLinear, DistributedModule
from shardkit.modelparallel.tp.lm_head import DistributedTransformerLMHead
from shardkit.modelparallel.tp.transformer import (
    DistributedAttentionLayer,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerOutputLayer,
)

__all__ = [
    "DistributedAttentionLayer",
    "DistributedEmbedding",
    "DistributedLinear",
    "DistributedModule",
    "DistributedTransformer",
    "DistributedTransformerLMHead",
    "DistributedTransformerLayer",
    "DistributedTransformerOutputLayer",
    "FusedLayerNorm",
    "huggingface",
]
