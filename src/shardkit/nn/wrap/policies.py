"""Auto-wrap policies: functions that tell :func:`~shardkit.nn.wrap.auto_wrap` where to cut a model into units.

A policy is asked two questions about each module while :func:`auto_wrap` walks the tree:

- ``recurse=True``: should the walk descend into this module's children? (asked before the children are visited)
- ``recurse=False``: should this module itself be wrapped? (asked after its children were handled, with the count
  of the parameters that no wrapped descendant took)

Two calling conventions are accepted, and :func:`auto_wrap` detects which one a policy follows:

- fairscale's, ``policy(module, recurse, unwrapped_params, module_is_root)``: the policies of this file follow it;
  ``module_is_root`` is True only for the module given to :func:`auto_wrap`.
- torch's, ``policy(module, recurse, nonwrapped_numel)``: :func:`size_based_auto_wrap_policy` and
  :func:`transformer_auto_wrap_policy` follow it, and so may any user policy.

Extra settings are bound with :func:`functools.partial`, for example
``functools.partial(default_auto_wrap_policy, min_num_params=10**6)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, Optional

from torch import nn

#: A wrap policy: ``policy(module, recurse, unwrapped_params, module_is_root)`` or
#: ``policy(module, recurse, nonwrapped_numel)``, returning a bool.
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
    unwrapped_params: Optional[int] = None,
    module_is_root: bool = False,
    min_num_params: float = int(1e8),
    force_leaf_modules: Optional[Iterable[type[nn.Module]]] = None,
    exclude_wrap_modules: Optional[Iterable[type[nn.Module]]] = None,
    skip_params_check_for_root: bool = False,
    *,
    nonwrapped_numel: Optional[int] = None,
) -> bool:
    """Size-based policy: wrap a module once it holds at least ``min_num_params`` not-yet-wrapped parameters.

    Descends into a module only when it is big enough and not a force-leaf type (default
    ``default_auto_wrap_policy.FORCE_LEAF_MODULES``, ``{nn.MultiheadAttention}``); wraps a module when its remaining
    parameters reach ``min_num_params`` and it is not an excluded container (default
    ``default_auto_wrap_policy.EXCLUDE_WRAP_MODULES``, ``{nn.ModuleList, nn.ModuleDict}``). A module smaller than
    the threshold is therefore never visited, and neither are its children. With ``skip_params_check_for_root``
    the root given to :func:`auto_wrap` is wrapped whatever its remaining size (unless it is excluded).

    The arguments are fairscale's, in fairscale's order. The two default sets are frozensets: extend them with
    ``default_auto_wrap_policy.FORCE_LEAF_MODULES.union({MyLayer})`` and pass the result as
    ``force_leaf_modules``. ``nonwrapped_numel`` is torch's name for ``unwrapped_params``, accepted in its place.

    Example::

        policy = functools.partial(default_auto_wrap_policy, min_num_params=10**6)
        with enable_wrap(wrapper_cls=FullyShardedDataParallel, auto_wrap_policy=policy):
            model = auto_wrap(model)
    """
    numel = _resolve_numel(unwrapped_params, nonwrapped_numel)
    defaults = vars(default_auto_wrap_policy)  # the function's own attributes, set below
    force_leaf = defaults["FORCE_LEAF_MODULES"] if force_leaf_modules is None else force_leaf_modules
    exclude = defaults["EXCLUDE_WRAP_MODULES"] if exclude_wrap_modules is None else exclude_wrap_modules
    is_large = numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(force_leaf))
    return (is_large or (module_is_root and skip_params_check_for_root)) and not isinstance(module, tuple(exclude))


# fairscale exposes the default sets on the function itself (``default_auto_wrap_policy.FORCE_LEAF_MODULES``);
# the policy reads them from there at each call, as fairscale's does.
vars(default_auto_wrap_policy).update(
    FORCE_LEAF_MODULES=DEFAULT_FORCE_LEAF_MODULES, EXCLUDE_WRAP_MODULES=DEFAULT_EXCLUDE_WRAP_MODULES
)


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: float = int(1e8),
    force_leaf_modules: Optional[Iterable[type[nn.Module]]] = None,
    exclude_wrap_modules: Optional[Iterable[type[nn.Module]]] = None,
) -> bool:
    """PyTorch's spelling of :func:`default_auto_wrap_policy`, with torch's argument order (no root flag).

    Example::

        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=10**6)
    """
    return default_auto_wrap_policy(
        module,
        recurse,
        nonwrapped_numel,
        min_num_params=min_num_params,
        force_leaf_modules=force_leaf_modules,
        exclude_wrap_modules=exclude_wrap_modules,
    )


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
    embeddings, the final norm) stay with whatever wraps the root. Follows torch's argument order.

    Example::

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        with enable_wrap(wrapper_cls=FullyShardedDataParallel, auto_wrap_policy=policy):
            model = auto_wrap(TransformerLM())  # each Block is now its own unit
    """
    _resolve_numel(unwrapped_params, nonwrapped_numel)
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
    unwrapped_params: Optional[int] = None,
    module_is_root: bool = False,
    *,
    nonwrapped_numel: Optional[int] = None,
) -> bool:
    """Tag-based policy: wrap exactly the modules that carry a ``wrapper_config`` attribute.

    ``wrapper_config`` is a dict of wrapper arguments; :func:`~shardkit.nn.wrap.wrap` applies it on top of the
    context's arguments (and below explicit overrides), so each tagged module can get its own settings. The
    parameter count and ``module_is_root`` are accepted (fairscale's signature) and not used.

    Example::

        model.encoder.wrapper_config = {"reshard_after_forward": False}
        with enable_wrap(wrapper_cls=FullyShardedDataParallel, auto_wrap_policy=config_auto_wrap_policy):
            model = auto_wrap(model)  # only model.encoder is wrapped
    """
    if recurse:
        return True
    return hasattr(module, "wrapper_config")


def _resolve_numel(unwrapped_params: Optional[int], nonwrapped_numel: Optional[int]) -> int:
    if nonwrapped_numel is not None and unwrapped_params is not None and nonwrapped_numel != unwrapped_params:
        raise TypeError(
            f"got both unwrapped_params={unwrapped_params} and nonwrapped_numel={nonwrapped_numel}; they name the "
            "same count (fairscale's and torch's spelling), pass only one"
        )
    numel = unwrapped_params if unwrapped_params is not None else nonwrapped_numel
    if numel is None:
        raise TypeError(
            "a size-based wrap policy needs the count of not-yet-wrapped parameters: pass unwrapped_params "
            "(fairscale) or nonwrapped_numel (torch)"
        )
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
