"""Wrap sub-modules of a model (typically with FSDP) under one shared configuration.

- :func:`enable_wrap` opens a context holding the wrapper class, its keyword arguments and a default policy.
- :func:`wrap` wraps one module inside that context and is a no-op outside it, so model code can annotate its
  large layers once and run wrapped or unwrapped.
- :func:`auto_wrap` walks a module tree and wraps what a policy selects, innermost first.
- Policies (:mod:`shardkit.nn.wrap.policies`): by size (:func:`default_auto_wrap_policy`), by class
  (:func:`transformer_auto_wrap_policy`) or by tag (:func:`config_auto_wrap_policy`); fairscale's four-argument
  and torch's three-argument policy signatures both work.
- Tied parameters are never split across units: :func:`auto_wrap` keeps the modules that share a parameter in
  their common parent's unit, and the FSDP constructor refuses a unit that would split a tie.
- :class:`ConfigAutoWrap` is fairscale's name for the context state (read-only here).

As in fairscale, the attribute ``wrap`` of :mod:`shardkit.nn` is the function :func:`wrap`, not this package:
``from shardkit.nn import wrap`` and ``from shardkit.nn.wrap import wrap`` both give the function; import the other
names from this package (``from shardkit.nn.wrap import enable_wrap``).

Example::

    from shardkit.nn import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import auto_wrap, enable_wrap, wrap

    with enable_wrap(wrapper_cls=FSDP, mixed_precision=True):
        l1 = wrap(torch.nn.Linear(5, 5))
        tfmr = auto_wrap(torch.nn.Transformer(num_encoder_layers=2, num_decoder_layers=2), min_num_params=1e6)
"""

from shardkit.nn.wrap.config_auto_wrap import ConfigAutoWrap
from shardkit.nn.wrap.context import WrapConfig, auto_wrap, current_wrap_config, enable_wrap, wrap
from shardkit.nn.wrap.policies import (
    DEFAULT_EXCLUDE_WRAP_MODULES,
    DEFAULT_FORCE_LEAF_MODULES,
    AutoWrapPolicy,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

__all__ = [
    "DEFAULT_EXCLUDE_WRAP_MODULES",
    "DEFAULT_FORCE_LEAF_MODULES",
    "AutoWrapPolicy",
    "ConfigAutoWrap",
    "WrapConfig",
    "auto_wrap",
    "config_auto_wrap_policy",
    "current_wrap_config",
    "default_auto_wrap_policy",
    "enable_wrap",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
