"""``smp.nn``: layers that SageMaker's smp ships in place of Apex's (same arguments, plain torch inside).

``DistributedLinear`` and the transformer blocks (``DistributedTransformer``, ``DistributedTransformerLayer``,
``DistributedAttentionLayer``, ``DistributedTransformerOutputLayer``) and ``DistributedEmbedding`` are smp's
tensor-parallel modules (see :mod:`shardkit.modelparallel.tp`); ``DistributedTransformerLMHead`` exists so scripts
import, and refuses construction with a clear error (not built yet).
``smp.nn.huggingface.gpt2`` translates GPT-2 state dicts between Hugging Face's layout and smp's.

Example::

    import shardkit.modelparallel as smp

    norm = smp.nn.FusedLayerNorm(1024)
"""

from shardkit.modelparallel.nn import huggingface
from shardkit.modelparallel.nn.fused_layer_norm import FusedLayerNorm
from shardkit.modelparallel.tensor_parallel import DISTRIBUTED_MODULES
from shardkit.modelparallel.tp.embedding import DistributedEmbedding
from shardkit.modelparallel.tp.layers import DistributedLinear, DistributedModule
from shardkit.modelparallel.tp.transformer import (
    DistributedAttentionLayer,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerOutputLayer,
)

DistributedTransformerLMHead = DISTRIBUTED_MODULES["DistributedTransformerLMHead"]

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
