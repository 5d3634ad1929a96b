"""The strategy registry: each data-parallel strategy by name, and how to build its model and optimizer.

It sits below the tools that run strategies (``shardkit bench``, ``shardkit demo``, ``shardkit plan``, and the
tests' builders, which all build through it) and above the strategy packages it builds (:mod:`shardkit.optim`,
:mod:`shardkit.nn`):

- :mod:`.registry`: :class:`~.registry.Strategy` entries by name, :func:`~.registry.select` for what runs here;
- :mod:`.builders`: each entry's builder, ``(model, optimizer spec, group, options, topology) -> (model,
  optimizer, after_step)``;
- :mod:`.options`: the builder contract and the option checks (:class:`~.options.OptionError`);
- :mod:`.live`: train one registered strategy step by step inside a worker and measure it.
"""
