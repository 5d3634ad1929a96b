"""``smp.nn``: layers that SageMaker's smp ships in place of Apex's (same arguments, plain torch inside).

``DistributedLinear`` is smp's tensor-parallel ``nn.Linear`` (see :mod:`shardkit.modelparallel.tp.layers`); the
other tensor-parallel ``smp.nn.Distributed*`` modules exist so scripts import, and refuse construction with a clear
error (not built yet; see :mod:`shardkit.modelparallel.tensor_parallel`).
``smp.nn.huggingface.gpt2`` translates GPT-2 state dicts between Hugging Face's layout and smp's.

Example::

    import shardkit.modelparallel as smp

    norm = smp.nn.FusedLayerNorm(1024)
"""

from shardkit.modelparallel.nn import huggingface
from shardkit.modelparallel.nn.fused_layer_norm import FusedLayerNorm
from shardkit.modelparallel.tensor_parallel import DISTRIBUTED_MODULES
from shardkit.modelparallel.tp.layers import DistributedLinear, DistributedModule

DistributedEmbedding = DISTRIBUTED_MODULES["DistributedEmbedding"]
DistributedAttentionLayer = DISTRIBUTED_MODULES["DistributedAttentionLayer"]
DistributedTransformer = DISTRIBUTED_MODULES["DistributedTransformer"]
DistributedTransformerLayer = DISTRIBUTED_MODULES["DistributedTransformerLayer"]
DistributedTransformerLMHead = DISTRIBUTED_MODULES["DistributedTransformerLMHead"]
DistributedTransformerOutputLayer = DISTRIBUTED_MODULES["DistributedTransformerOutputLayer"]

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
