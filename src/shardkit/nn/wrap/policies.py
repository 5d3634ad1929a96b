"""Auto-wrap policies: functions that tell :func:`~shardkit.nn.wrap.auto_wrap` where to cut a model into units.

Every policy has the signature ``policy(module, recurse, nonwrapped_numel) -> bool`` and is asked two questions
about each module while :func:`auto_wrap` walks the tree:

- ``recurse=True``: should the walk descend into this module's children? (asked before the children are visited)
- ``recurse=False``: should this module itself be wrapped? (asked after its children were handled, with
  ``nonwrapped_numel`` counting only the parameters that no wrapped descendant took)

Extra settings are bound with :func:`functools.partial`, for example
``functools.partial(default_auto_wrap_policy, min_num_params=10**6)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, Optional

from torch import nn

#: The policy signature: ``policy(module, recurse, nonwrapped_numel) -> bool``.
AutoWrapPolicy = Callable[..., bool]

#: Modules :func:`default_auto_wrap_policy` never descends into: their children stay unwrapped because the parent
#: reaches into them directly (``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``).
DEFAULT_FORCE_LEAF_MODULES: frozenset[type[nn.Module]] = frozenset({nn.MultiheadAttention})

#: Containers :func:`default_auto_wrap_policy` never wraps: they have no ``forward``, so a wrapper around them
#: would never run.
DEFAULT_EXCLUDE_WRAP_MODULES: frozenset[type[nn.Module]] = frozenset({nn.ModuleList, nn.ModuleDict})


def default_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: Optional[int] = None,
    min_num_params: float = int(1e8),
    force_leaf_modules: Optional[Iterable[type[nn.Module]]] = None,
    exclude_wrap_modules: Optional[Iterable[type[nn.Module]]] = None,
    *,
    unwrapped_params: Optional[int] = None,
) -> bool:
    """Size-based policy: wrap a module once it holds at least ``min_num_params`` not-yet-wrapped parameters.

    Descends into a module only when it is big enough and not a force-leaf type (default
    ``{nn.MultiheadAttention}``); wraps a module when its remaining parameters reach ``min_num_params`` and it is
    not an excluded container (default ``{nn.ModuleList, nn.ModuleDict}``). A module smaller than the threshold is
    therefore never visited, and neither are its children.

    ``unwrapped_params`` is fairscale's name for ``nonwrapped_numel`` and is accepted in its place.

    Example::

        policy = functools.partial(default_auto_wrap_policy, min_num_params=10**6)
        with enable_wrap(wrapper_cls=FullyShardedDataParallel, auto_wrap_policy=policy):
            model = auto_wrap(model)
    """
    numel = _resolve_numel(nonwrapped_numel, unwrapped_params)
    force_leaf = DEFAULT_FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules
    exclude = DEFAULT_EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules
    is_large = numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(force_leaf))
    return is_large and not isinstance(module, tuple(exclude))


#: PyTorch's name for the same size-based policy.
size_based_auto_wrap_policy = default_auto_wrap_policy


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: Optional[int] = None,
    transformer_layer_cls: Iterable[type[nn.Module]] = (),
    *,
    unwrapped_params: Optional[int] = None,
) -> bool:
    """Class-based policy: wrap every instance of ``transformer_layer_cls`` (typically the transformer block).

    Always descends, so blocks at any depth are found; sizes are ignored. Parameters outside every block (the
    embeddings, the final norm) stay with whatever wraps the root.

    Example::

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        with enable_wrap(wrapper_cls=FullyShardedDataParallel, auto_wrap_policy=policy):
            model = auto_wrap(TransformerLM())  # each Block is now its own unit
    """
    _resolve_numel(nonwrapped_numel, unwrapped_params)
    classes = tuple(transformer_layer_cls)
    if not classes:
        raise ValueError(
            "transformer_auto_wrap_policy needs transformer_layer_cls, the module classes to wrap; bind it with "
            "functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={MyBlock})"
        )
    if recurse:
        return True
    return isinstance(module, classes)


def config_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: Optional[int] = None,
    *,
    unwrapped_params: Optional[int] = None,
) -> bool:
    """Tag-based policy: wrap exactly the modules that carry a ``wrapper_config`` attribute.

    ``wrapper_config`` is a dict of wrapper arguments; :func:`~shardkit.nn.wrap.wrap` applies it on top of the
    context's arguments (and below explicit overrides), so each tagged module can get its own settings.

    Example::

        model.encoder.wrapper_config = {"reshard_after_forward": False}
        with enable_wrap(wrapper_cls=FullyShardedDataParallel, auto_wrap_policy=config_auto_wrap_policy):
            model = auto_wrap(model)  # only model.encoder is wrapped
    """
    _resolve_numel(nonwrapped_numel, unwrapped_params)
    if recurse:
        return True
    return hasattr(module, "wrapper_config")


def _resolve_numel(nonwrapped_numel: Optional[int], unwrapped_params: Optional[int]) -> int:
    if nonwrapped_numel is not None and unwrapped_params is not None and nonwrapped_numel != unwrapped_params:
        raise TypeError(
            f"got both nonwrapped_numel={nonwrapped_numel} and unwrapped_params={unwrapped_params}; they name the "
            "same count, pass only one"
        )
    numel = nonwrapped_numel if nonwrapped_numel is not None else unwrapped_params
    if numel is None:
        raise TypeError("a wrap policy needs the count of not-yet-wrapped parameters (nonwrapped_numel)")
    return numel


__all__ = [
    "DEFAULT_EXCLUDE_WRAP_MODULES",
    "DEFAULT_FORCE_LEAF_MODULES",
    "AutoWrapPolicy",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
]
