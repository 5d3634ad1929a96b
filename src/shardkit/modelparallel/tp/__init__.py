"""smp's tensor parallelism over the core :mod:`shardkit.tensor_parallel`: which modules become distributed
(:mod:`.registry`), the ``smp.nn`` distributed modules (:mod:`.layers`), and the replacement when
``smp.DistributedModel`` wraps a model (:mod:`.distribute`)."""
