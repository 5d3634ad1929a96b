"""fairscale's ``nn.model_parallel.layers``: the split layers, with fairscale's arguments and meanings.

They are :mod:`shardkit.tensor_parallel`'s layers, which take fairscale's positional arguments
(``ColumnParallelLinear(in_features, out_features, bias=True, gather_output=True, init_method=xavier_normal_,
stride=1, keep_master_weight_for_test=False)``, ``RowParallelLinear(..., input_is_parallel=False, ...)``,
``ParallelEmbedding`` and ``VocabParallelEmbedding`` with ``nn.Embedding``'s options and ``init_method``) and use the
groups :func:`~shardkit.nn.model_parallel.initialize.initialize_model_parallel` made.
"""

from shardkit.tensor_parallel import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, VocabParallelEmbedding

__all__ = ["ColumnParallelLinear", "ParallelEmbedding", "RowParallelLinear", "VocabParallelEmbedding"]
