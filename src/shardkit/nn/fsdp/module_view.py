"""What ``fsdp.module`` returns: the user's module, reachable by both of fairscale's spellings.

In fairscale, a unit that flattens its parameters (the default) puts a flattening wrapper between itself and the
user's module: ``fsdp.module`` is that wrapper, ``fsdp.module.module`` is the user's module, and any other
attribute read on the wrapper falls through to the user's module. Code written against fairscale uses both
spellings (a trainer unwrapping the model with ``fsdp.module.module``, a model reading ``fsdp.module.encoder``).

shardkit has no such wrapper level in its module tree (state dict keys, ``named_modules`` and hooks stay the
unwrapped model's), so :class:`FlatModuleView` is a view, not a module in the tree: ``.module`` on it is the
user's module and everything else is the user's module's own answer (attributes, calls, ``isinstance``,
equality and hashing). The user's module itself is not modified. ``view is user_module`` is False; compare
with ``==`` or go through ``.module``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from torch import nn


class FlatModuleView:
    """Stands for the wrapped module at fairscale's flattening-wrapper level (see the module docstring).

    Example::

        model = FullyShardedDataParallel(Net())
        model.module.module          # the Net instance
        model.module.encoder         # Net's encoder, as model.module.module.encoder
        isinstance(model.module, Net), model.module == model.module.module   # True, True
    """

    __slots__ = ("_target",)

    def __init__(self, target: nn.Module) -> None:
        object.__setattr__(self, "_target", target)

    @property
    def module(self) -> nn.Module:
        """The user's module."""
        target: nn.Module = object.__getattribute__(self, "_target")
        return target

    @property
    def _fpw_module(self) -> nn.Module:
        """The user's module under fairscale's private name for it."""
        return self.module

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(view, UserModel) holds, as it did for the module itself
        return type(self.module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.module, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return self.module is (other.module if isinstance(other, FlatModuleView) else other)

    def __hash__(self) -> int:
        return hash(self.module)

    def __repr__(self) -> str:
        return repr(self.module)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self.module)) | {"module"})

    def __iter__(self) -> Iterator[Any]:
        container: Any = self.module  # a container module (nn.Sequential, nn.ModuleList)
        return iter(container)

    def __len__(self) -> int:
        container: Any = self.module
        return len(container)

    def __bool__(self) -> bool:
        return bool(self.module)

    def __getitem__(self, key: Any) -> Any:
        container: Any = self.module
        return container[key]

    def __contains__(self, item: Any) -> bool:
        container: Any = self.module
        return item in container

    def __copy__(self) -> nn.Module:
        return copy.copy(self.module)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        return copy.deepcopy(self.module, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.module.__reduce_ex__(protocol)


def is_view(obj: Any) -> bool:
    """True for a :class:`FlatModuleView` (whose ``__class__`` answers the user's class)."""
    return type(obj) is FlatModuleView
