"""fairscale's ``nn.model_parallel`` (Megatron-style tensor parallelism), as a thin face over
:mod:`shardkit.tensor_parallel`.

Code written against fairscale, such as Meta's Llama reference model, runs by changing the import::

    import shardkit.nn.model_parallel.initialize as fs_init
    from shardkit.nn.model_parallel.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear

    torch.distributed.init_process_group("gloo")      # torchrun --nproc-per-node 2
    fs_init.initialize_model_parallel(2)
    wq = ColumnParallelLinear(dim, n_heads * head_dim, bias=False, gather_output=False, init_method=lambda x: x)
    wo = RowParallelLinear(n_heads * head_dim, dim, bias=False, input_is_parallel=True, init_method=lambda x: x)

The submodules keep fairscale's paths: :mod:`.initialize` (the groups), :mod:`.layers`, :mod:`.mappings`,
:mod:`.cross_entropy`, :mod:`.random` and :mod:`.utils`. Per-rank checkpoint files (``consolidated.0N.pth``) load
with :func:`shardkit.tensor_parallel.load_shard_file`, which checks the file fits the rank.
"""

from shardkit.nn.model_parallel.cross_entropy import vocab_parallel_cross_entropy
from shardkit.nn.model_parallel.initialize import (
    destroy_model_parallel,
    get_context_parallel_group,
    get_context_parallel_rank,
    get_context_parallel_ranks,
    get_context_parallel_world_size,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_ranks,
    get_data_parallel_world_size,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_src_rank,
    get_model_parallel_world_size,
    get_pipeline_parallel_group,
    get_pipeline_parallel_ranks,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from shardkit.nn.model_parallel.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from shardkit.nn.model_parallel.mappings import (
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    reduce_from_model_parallel_region,
    scatter_to_model_parallel_region,
)
from shardkit.nn.model_parallel.random import (
    CudaRNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)

__all__ = [
    "ColumnParallelLinear",
    "CudaRNGStatesTracker",
    "ParallelEmbedding",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "checkpoint",
    "copy_to_model_parallel_region",
    "destroy_model_parallel",
    "gather_from_model_parallel_region",
    "get_context_parallel_group",
    "get_context_parallel_rank",
    "get_context_parallel_ranks",
    "get_context_parallel_world_size",
    "get_cuda_rng_tracker",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_ranks",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_src_rank",
    "get_model_parallel_world_size",
    "get_pipeline_parallel_group",
    "get_pipeline_parallel_ranks",
    "initialize_model_parallel",
    "model_parallel_cuda_manual_seed",
    "model_parallel_is_initialized",
    "reduce_from_model_parallel_region",
    "scatter_to_model_parallel_region",
    "vocab_parallel_cross_entropy",
]
