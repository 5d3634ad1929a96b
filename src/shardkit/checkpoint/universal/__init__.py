"""The universal checkpoint layout: every strategy's state as DCP shards keyed by the unwrapped model's names.

A strategy says what a rank holds (:mod:`.source`: :class:`~.source.Held` tensors made of
:class:`~.source.Span` flat ranges of named full tensors); the engine does the rest, the same for every strategy:

- :mod:`.placement`: the contract: keys, flat ranges as memory-contiguous boxes;
- :mod:`.split`: a tensor-parallel rank's slab of a tensor (any split dimension, any stride) as boxes of the full one;
- :mod:`.plans`: DCP save and load planners (one chunk per box; reads exactly the boxes a rank needs);
- :mod:`.optim_state` and :mod:`.side`: optimizer state by parameter name, settings in JSON side files;
- :mod:`.save`, :mod:`.load`: staging and writing; validating and reading in place;
- :mod:`.background`: asynchronous saves; :mod:`.whole`: sources of whole tensors (plain, DDP, OSS);
- :mod:`.layout`: file names inside a checkpoint.

Which source serves a model is chosen above the engine and the adapters (:mod:`shardkit.checkpoint.sources`);
writing tensors in hand is a tool (:mod:`shardkit.checkpoint.tools.write`).
"""
