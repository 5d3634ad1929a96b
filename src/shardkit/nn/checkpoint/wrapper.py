"""The activation-checkpointing wrapper: recompute a module's forward during backward instead of storing it.

torch's non-reentrant ``torch.utils.checkpoint`` is the engine. This module adds the semantics users of
fairscale's ``checkpoint_wrapper`` rely on:

- keyword arguments and non-tensor outputs pass through (keyword tensors are saved like positional ones, so
  ``offload_to_cpu`` moves them too);
- the RNG state is replayed, so dropout draws the same mask in the recomputation;
- forward side effects on normalisation statistics happen once: running mean/variance and the batch counter
  are restored after the recomputation (:mod:`shardkit.nn.checkpoint.norm_stats`);
- in eval mode, under ``torch.no_grad()`` or inside :func:`~shardkit.nn.checkpoint.flags.disable_checkpointing`
  the module runs a plain forward;
- :func:`~shardkit.nn.checkpoint.flags.is_checkpointing` is True inside the checkpointed forward and
  :func:`~shardkit.nn.checkpoint.flags.is_recomputing` inside its recomputation, on whichever thread autograd
  runs it;
- ``state_dict`` and ``named_parameters`` use the wrapped module's names, so checkpoints load into the
  unwrapped model and back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardkit.nn._torch_private import state_dict_metadata
from shardkit.nn.checkpoint.flags import enable_checkpointing, enable_recomputing, is_checkpointing_disabled
from shardkit.nn.checkpoint.norm_stats import restore_norm_stats_after
from shardkit.nn.checkpoint.offload import ActivationOffload
from shardkit.tensor_parallel.random import replay_rng_tracker

#: The child name the wrapped module is registered under; stripped from every name the wrapper reports.
WRAPPED_NAME = "_checkpoint_wrapped_module"
_INFIX = WRAPPED_NAME + "."


class CheckpointWrapper(nn.Module):
    """Run ``module`` under non-reentrant activation checkpointing; build it with :func:`checkpoint_wrapper`.

    Attribute access that the wrapper does not answer itself is forwarded to the wrapped module, so
    ``wrapper.fc1`` still works. The wrapped module is :attr:`wrapped_module`.
    """

    def __init__(self, module: nn.Module, offload_to_cpu: bool = False) -> None:
        super().__init__()
        self.offload_to_cpu = offload_to_cpu
        self.add_module(WRAPPED_NAME, module)
        self.register_state_dict_post_hook(_strip_names_on_save)
        self.register_load_state_dict_pre_hook(_add_names_on_load)
        self.register_load_state_dict_post_hook(_strip_names_in_report)

    @property
    def wrapped_module(self) -> nn.Module:
        """The module whose activations are recomputed."""
        return self._modules[WRAPPED_NAME]  # type: ignore[return-value]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED_NAME:
                raise
            return getattr(self.wrapped_module, name)

    def __getitem__(self, index: Any) -> Any:
        return self.wrapped_module[index]  # type: ignore[index]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.wrapped_module
        if not (self.training and torch.is_grad_enabled()) or is_checkpointing_disabled():
            return inner(*args, **kwargs)
        with self._offload_context((*args, *kwargs.values())):
            return checkpointed_call(inner, inner, args, kwargs)

    def _offload_context(self, inputs: tuple[Any, ...]) -> contextlib.AbstractContextManager[Any]:
        # Only the checkpoint's inputs are saved across the region, so they are what goes to host memory.
        # Copying tensors that already live on the CPU would only double them, hence the device test. CUDA
        # tensors go down asynchronously on a side stream; others through shardkit::to_host (see offload.py).
        devices = {x.device.type for x in inputs if isinstance(x, torch.Tensor)}
        if not self.offload_to_cpu or devices <= {"cpu"}:
            return contextlib.nullcontext()
        return ActivationOffload(pin="cuda" in devices).hooks()

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Like :meth:`torch.nn.Module.named_parameters`, with the names of the unwrapped module."""
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield name.replace(_INFIX, ""), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Like :meth:`torch.nn.Module.named_buffers`, with the names of the unwrapped module."""
        for name, buf in super().named_buffers(prefix, recurse, remove_duplicate):
            yield name.replace(_INFIX, ""), buf

    def extra_repr(self) -> str:
        return f"offload_to_cpu={self.offload_to_cpu}"


def checkpointed_call(
    fn: Callable[..., Any],
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    preserve_rng_state: bool = True,
) -> Any:
    """``fn(*args, **kwargs)`` under non-reentrant checkpointing, with this package's semantics for ``module``
    (the module ``fn`` runs: its normalisation statistics are restored after the recomputation, and
    :func:`~shardkit.nn.checkpoint.flags.is_checkpointing` / ``is_recomputing`` hold inside).

    The caller decides whether to checkpoint at all (training, grad enabled, not disabled). Keyword values
    travel as positional inputs so the checkpoint saves (and an offload hook moves) them like the rest.
    ``preserve_rng_state=False`` skips replaying the RNG state (dropout then draws new masks when recomputed).
    """
    kw_names = tuple(kwargs)
    num_positional = len(args)

    def run(*inputs: Any) -> Any:
        return fn(*inputs[:num_positional], **dict(zip(kw_names, inputs[num_positional:])))

    return checkpoint(
        run,
        *args,
        *kwargs.values(),
        use_reentrant=False,
        preserve_rng_state=preserve_rng_state,
        # the model-parallel RNG tracker's streams are captured here, at the forward, and replayed with the default
        # generators' (which torch's checkpoint replays itself), so tensor-parallel dropout recomputes its masks
        context_fn=lambda: (enable_checkpointing(), _recomputation(module, replay_rng_tracker())),
    )


@contextlib.contextmanager
def _recomputation(module: nn.Module, rng_replay: contextlib.AbstractContextManager[None]) -> Iterator[None]:
    """Entered by torch's checkpoint around the recomputation, on the thread that runs it (any autograd thread)."""
    with enable_recomputing(), restore_norm_stats_after(module), rng_replay:
        yield


def adds_no_name(parent: nn.Module, child_name: str) -> bool:
    """True when ``parent``'s child ``child_name`` adds no segment to the names of the parameters below it.

    Code that names parameters by walking ``_modules`` itself (FSDP's state dicts do) asks this so that a
    :class:`CheckpointWrapper` inside the walk keeps the unwrapped model's names, as its own hooks do for
    ``nn.Module.state_dict``.
    """
    return isinstance(parent, CheckpointWrapper) and child_name == WRAPPED_NAME


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> CheckpointWrapper:
    """Wrap ``module`` so its activations are recomputed in backward instead of kept from forward.

        Only the module's inputs are kept between forward and backward; everything computed inside is recomputed
        when backward reaches it, trading one extra forward for the activation memory. Dropout masks are the same
        in the recomputation, BatchNorm statistics are updated once, and eval / ``no_grad`` forwards (and those inside
    :func:`~shardkit.nn.checkpoint.flags.disable_checkpointing`) run plainly.

        Args:
            module: the module to checkpoint, typically one transformer block.
            offload_to_cpu: keep the saved inputs in host memory (pinned when they come from CUDA) and copy them
                back for the recomputation. Inputs that already live on the CPU are left alone.

        Returns:
            A :class:`CheckpointWrapper`; its ``state_dict`` keys equal the unwrapped module's. It composes with
            sharding: ``FullyShardedDataParallel(checkpoint_wrapper(block))``.

        Example::

            block = checkpoint_wrapper(TransformerBlock(cfg))
            loss = block(x, attention_mask=mask).sum()
            loss.backward()  # block's forward runs a second time here
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_wrapper expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, CheckpointWrapper):
        raise ValueError(
            "checkpoint_wrapper got a module that is already checkpointed; wrapping twice only recomputes twice. "
            "Pass the inner module (wrapper.wrapped_module) if you want to change offload_to_cpu."
        )
    return CheckpointWrapper(module, offload_to_cpu=offload_to_cpu)


def _strip_names_on_save(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    # The wrapper's own entries were added last, so popping and re-inserting them keeps the dict's order.
    inner_prefix = prefix + _INFIX
    for key in [k for k in state_dict if k.startswith(inner_prefix)]:
        state_dict[prefix + key[len(inner_prefix) :]] = state_dict.pop(key)
    metadata = state_dict_metadata(state_dict)
    if metadata is None:
        return
    # Metadata (module versions) is keyed by module path without the trailing dot; the inner module's entry
    # replaces the wrapper's own, so version-dependent loading of the inner module keeps working.
    inner_key = prefix + WRAPPED_NAME
    for key in [k for k in metadata if k == inner_key or k.startswith(inner_key + ".")]:
        new_key = prefix[:-1] if key == inner_key else prefix + key[len(inner_key) + 1 :]
        metadata[new_key] = metadata.pop(key)


def _add_names_on_load(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    inner_prefix = prefix + _INFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner_prefix)]:
        state_dict[inner_prefix + key[len(prefix) :]] = state_dict.pop(key)


def _strip_names_in_report(module: nn.Module, incompatible_keys: Any) -> None:
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [k.replace(_INFIX, "") for k in keys]
