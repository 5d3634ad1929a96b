"""What an original parameter attribute holds between steps: a placeholder with its shape, no values.

Between steps a unit keeps only its flat shards; the full parameters are freed. The submodules still need an
attribute under each parameter's name: ``print(model)`` runs ``nn.Linear.extra_repr`` (reads ``self.bias``),
Hugging Face reads ``embedding.weight.dtype``, users read ``model.module.fc.weight.shape``. A
:class:`ShardedParamPlaceholder` answers those metadata questions (shape, dtype, device, requires_grad, numel)
and holds no memory (a tensor subclass without storage). Any operation that would read or write values raises an
error naming the parameter and saying how to reach the real values, instead of returning garbage or reading
freed memory.

One placeholder per original parameter is created when the unit is wrapped and reused every step, so putting
it back after a forward costs one ``setattr``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from shardkit.utils.wrapper_tensor import NO_TORCH_FUNCTION, new_wrapper


class ShardedParamPlaceholder(torch.Tensor):
    """Stands in for a sharded parameter between steps: right shape, dtype and device; no storage, no values.

    Example::

        model = FullyShardedDataParallel(nn.Linear(4, 2))
        model.module.weight.shape            # torch.Size([2, 4])
        model.module.weight + 1              # RuntimeError: ... use summon_full_params()
        with model.summon_full_params():
            model.module.weight + 1          # the real, full parameter
    """

    #: The parameter's name relative to the wrapped module, e.g. ``"fc.weight"``.
    fqn: str
    #: The unit that shards it, for messages.
    unit_name: str

    @staticmethod
    def __new__(
        cls, shape: torch.Size, dtype: torch.dtype, device: torch.device, requires_grad: bool, fqn: str, unit: str
    ) -> ShardedParamPlaceholder:
        placeholder = new_wrapper(cls, shape, dtype, device, requires_grad)
        placeholder.fqn = fqn
        placeholder.unit_name = unit
        return placeholder

    # Metadata (shape, dtype, device, numel, dim) is answered without dispatch; every operator ends up here.
    __torch_function__ = NO_TORCH_FUNCTION

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        placeholder = next(
            (a for a in (*args, *(kwargs or {}).values()) if isinstance(a, ShardedParamPlaceholder)), None
        )
        raise RuntimeError(sharded_error(placeholder, str(func)))

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"ShardedParamPlaceholder('{self.fqn}', shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}: sharded by FullyShardedDataParallel; values only inside forward or "
            "summon_full_params())"
        )

    def _described_by(self) -> tuple[torch.Size, torch.dtype, torch.device, bool, str, str]:
        return self.shape, self.dtype, self.device, self.requires_grad, self.fqn, self.unit_name

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedParamPlaceholder:
        return ShardedParamPlaceholder(*self._described_by())

    def __reduce_ex__(self, protocol: Any) -> Any:
        return ShardedParamPlaceholder, self._described_by()


def sharded_error(placeholder: Optional[ShardedParamPlaceholder], operation: str) -> str:
    """The message for an operation on a placeholder: which parameter, and the ways to its values."""
    name = f"'{placeholder.fqn}' of unit '{placeholder.unit_name}'" if placeholder is not None else "a parameter"
    return (
        f"{operation} on parameter {name}, which is sharded by FullyShardedDataParallel: between steps the "
        "attribute is a placeholder that only knows its shape, dtype and device (the full values are freed). "
        "Read or edit the values inside `with model.summon_full_params():`, use model.state_dict(), or run them "
        "through the model's forward; for another entry point such as generate(), call "
        "model.register_forward_method('generate') once and then model.generate(...)."
    )
