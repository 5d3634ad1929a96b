"""``smp.delay_param_initialization``: build a model too big for one process, create only the stage's share.

Inside the context every tensor a module creates lives on the ``meta`` device (shapes and dtypes, no memory).
At the first step rank 0 plans the partition on those shapes, and each rank then creates the parameters and
buffers its stage holds, on its device, by calling ``reset_parameters()`` of each module that owns them. So no
process ever holds the whole model.

Hugging Face models: a module inside a ``transformers`` ``PreTrainedModel`` is initialised as HF's ``post_init``
does it, by the model's ``_init_weights``: after its own ``reset_parameters()`` (when it has one, as its
``__init__`` would have run it), ``_init_weights`` is applied to the module and then to each of its ancestors up to
that model, nearest first (GPT-2's attention block rescales its child ``c_proj`` there), with every other tensor
already created marked ``_is_hf_initialized`` so that HF's init functions leave it alone. So HF's ``Conv1D``, which
has no ``reset_parameters()``, is created too. Floating-point tensors start as NaN and integer ones at their
lowest value: one still holding that afterwards was not initialised by anything (boolean tensors cannot be
checked), and the partition fails on every rank naming its module.

Values: module ``name`` is reset under ``torch.manual_seed(initialization_seed(base, name))``, modules in
``named_modules()`` order, where ``base`` is rank 0's ``torch.initial_seed()`` at the partition. The values
equal those of the whole model built normally and reset module by module that way, whatever the partition:
stages, replicas and tied copies agree without any broadcast. A module that owns parameters or buffers but has
no ``reset_parameters()`` cannot be recreated (values its ``__init__`` computed were never stored) and is
refused at the partition, naming it.

Layers split across tensor-parallel ranks (smp tensor parallelism on a delayed model) hold slices, which no
initialisation of their own could make equal to the unsplit model's. ``materialize`` initialises each through the
whole module it replaced (a :class:`WholeModule`): the whole module takes the layer's place in the model for the
call, is created and initialised at full size exactly as above (same name, same seed, same ancestors), and the layer
keeps its slices of the result. One whole module at a time exists, for the length of its initialisation.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from shardkit.modelparallel.building.startup import canonical_tensors


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Create modules inside without allocating their parameters; each stage creates its own after the partition.

    Example::

        with smp.delay_param_initialization():
            model = BigModel()                  # no memory used for weights yet
        model = smp.DistributedModel(model)     # the first step partitions, then each stage initialises its share
    """
    if not enabled:
        yield
        return

    def mark(module: nn.Module, name: str, tensor: Optional[torch.Tensor]) -> None:
        if tensor is not None and tensor.is_meta:
            setattr(tensor, DELAYED_MARK, True)

    # The registration hooks are torch's global ones, so they are open only while the context is.
    param_hook = register_module_parameter_registration_hook(mark)
    buffer_hook = register_module_buffer_registration_hook(mark)
    try:
        with torch.device("meta"):
            yield
    finally:
        param_hook.remove()
        buffer_hook.remove()


#: Set on every parameter and buffer a module registers inside :func:`delay_param_initialization`.
DELAYED_MARK = "shardkit_delayed_init"

#: The name smp's ``model_creation`` documentation uses for the same context.
delayed_parameter_initialization = delay_param_initialization


def _delayed(tensor: torch.Tensor) -> bool:
    return tensor.is_meta and getattr(tensor, DELAYED_MARK, False)


def is_delayed(module: nn.Module) -> bool:
    """True when ``module``'s parameters and buffers were created inside :func:`delay_param_initialization`.

    Only tensors the context registered count: a model merely built on the meta device (as ``shardkit plan``
    builds every model) is not delayed, and is partitioned on meta like any other."""
    tensors = list(canonical_tensors(module).values())
    return bool(tensors) and all(_delayed(t) for t in tensors)


def check_delayable(module: nn.Module) -> None:
    """For a model built inside :func:`delay_param_initialization`: raise ``ValueError`` unless every module owning
    tensors can recreate them (``reset_parameters``), or when only some tensors are on the meta device (a model
    half built inside the context). Other models pass."""
    tensors = list(canonical_tensors(module).values())
    if not any(_delayed(t) for t in tensors):
        return
    if not all(_delayed(t) for t in tensors):
        raise ValueError(
            "part of the model was built inside smp.delay_param_initialization and part outside it: build the "
            "whole model inside the context, or none of it"
        )
    modules = dict(module.named_modules())
    missing = [
        f"{name or '<root>'} ({type(sub).__name__})"
        for name, sub in modules.items()
        if _direct_tensors(sub)
        and not callable(getattr(sub, "reset_parameters", None))
        and not _hf_init_chain(modules, name)
    ]
    if missing:
        raise ValueError(
            "smp.delay_param_initialization creates parameters and buffers after the partition by calling each "
            "module's reset_parameters() (or, inside a Hugging Face PreTrainedModel, its _init_weights), but these "
            f"modules own tensors and have neither: {', '.join(missing[:5])}"
            f"{'...' if len(missing) > 5 else ''}; give them a reset_parameters() method, or build the model "
            "outside the context"
        )


def initialization_seed(base: int, name: str) -> int:
    """The seed module ``name`` is reset under (``base`` is rank 0's ``torch.initial_seed()``)."""
    return (base + zlib.crc32(name.encode())) % (2**63)


def _direct_named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def _direct_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for _, t in _direct_named_tensors(module)]


@dataclass(frozen=True)
class WholeModule:
    """The unsplit module a tensor-parallel layer replaced (its tensors on the meta device), and ``cut(name, full)``:
    this rank's slice of the whole tensor ``name`` (the layer's tensors have the whole module's names)."""

    module: nn.Module
    cut: Callable[[str, torch.Tensor], torch.Tensor]


def materialize(
    module: nn.Module,
    holds: Callable[[str], bool],
    device: torch.device,
    base_seed: int,
    whole_of: Callable[[nn.Module], Optional[WholeModule]] = lambda _: None,
) -> list[str]:
    """Create on ``device`` the tensors this stage holds (``holds(canonical_name)``) and initialise them.

    Runs before the stage releases what it does not hold. Every module owning a held tensor is reset (seeded per
    :func:`initialization_seed`); its tensors this stage does not hold exist only during that call, so a tied
    tensor gets the value the last module resetting it gives it, on every stage that holds it, as in the
    unpartitioned model. A module for which ``whole_of`` gives a :class:`WholeModule` is initialised through it
    (see the module docstring). Returns the modules whose held floating-point tensors nothing initialised (empty
    when all is well; the caller raises on every rank).
    """
    canonical = {id(t): name for name, t in canonical_tensors(module).items()}
    modules = dict(module.named_modules())
    uninitialised: list[str] = []
    with torch.no_grad():
        for name, sub in modules.items():
            direct = _direct_tensors(sub)
            if not any(holds(canonical[id(t)]) for t in direct):
                continue
            whole = whole_of(sub)
            if whole is None:
                for t in direct:
                    if t.is_meta:
                        _replace(t, _unset(torch.empty(t.shape, dtype=t.dtype, device=device)))
                _seeded_initialise(module, modules, name, sub, device, base_seed)
            else:
                _initialise_through(module, modules, name, whole, device, base_seed)
            if any(_still_unset(t) for t in direct):
                uninitialised.append(f"{name or '<root>'} ({type(sub).__name__})")
            for t in direct:
                if not holds(canonical[id(t)]) and not t.is_meta:
                    _replace(t, torch.empty(t.shape, dtype=t.dtype, device="meta"))
    return uninitialised


def _seeded_initialise(
    root: nn.Module, modules: dict[str, nn.Module], name: str, sub: nn.Module, device: torch.device, base_seed: int
) -> None:
    """:func:`_initialise` under module ``name``'s seed; the user's random streams continue as if nothing was drawn
    (the CUDA one too when initialising there)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(initialization_seed(base_seed, name))
        _initialise(root, modules, name, sub)


def _initialise_through(
    root: nn.Module, modules: dict[str, nn.Module], name: str, whole: WholeModule, device: torch.device, seed: int
) -> None:
    """Initialise the split layer at ``name`` through ``whole``: in the layer's place, created at full size and
    initialised as the unsplit model's module; the layer keeps its slices; the whole module back on meta."""
    layer = modules[name]
    parent_name, _, child = name.rpartition(".")
    parent = modules[parent_name]
    full = dict(_direct_named_tensors(whole.module))
    setattr(parent, child, whole.module)
    try:
        for t in full.values():
            _replace(t, _unset(torch.empty(t.shape, dtype=t.dtype, device=device)))
        _seeded_initialise(root, {**modules, name: whole.module}, name, whole.module, device, seed)
        for tensor_name, t in _direct_named_tensors(layer):
            piece = whole.cut(tensor_name, full[tensor_name])
            if piece.shape != t.shape:
                raise ValueError(
                    f"delayed initialisation of the split layer '{name}': the slice of '{tensor_name}' has shape "
                    f"{tuple(piece.shape)}, the layer holds {tuple(t.shape)}"
                )
            _replace(t, piece.to(dtype=t.dtype).clone())
    finally:
        setattr(parent, child, layer)
        for t in full.values():
            _replace(t, torch.empty(t.shape, dtype=t.dtype, device="meta"))


def _unset(t: torch.Tensor) -> torch.Tensor:
    """``t`` filled with what no initialisation leaves: NaN, or an integer tensor's lowest value."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.fill_(float("nan"))
    if t.dtype != torch.bool:
        return t.fill_(torch.iinfo(t.dtype).min)
    return t


def _still_unset(t: torch.Tensor) -> bool:
    """Some of ``t`` is NaN (floating point), or all of it still holds the integer fill (see :func:`_unset`)."""
    if t.is_meta or t.numel() == 0:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).any())
    if t.dtype != torch.bool:
        return bool((t == torch.iinfo(t.dtype).min).all())
    return False


def _initialise(root: nn.Module, modules: dict[str, nn.Module], name: str, sub: nn.Module) -> None:
    """``sub.reset_parameters()`` if it has one, then HF's ``_init_weights`` on it and its ancestors (see the
    module docstring), other created tensors shielded by ``_is_hf_initialized``."""
    reset = getattr(sub, "reset_parameters", None)
    if callable(reset):
        reset()
    chain = _hf_init_chain(modules, name)
    if not chain:
        return
    own = {id(t) for t in _direct_tensors(sub)}
    shielded = [
        t
        for t in canonical_tensors(root).values()
        if id(t) not in own and not t.is_meta and not getattr(t, _HF_DONE, False)
    ]
    for t in shielded:
        setattr(t, _HF_DONE, True)
    try:
        for owner, target in chain:
            init_weights: Callable[[nn.Module], None] = getattr(owner, "_init_weights")  # noqa: B009
            init_weights(target)
    finally:
        for t in shielded:
            delattr(t, _HF_DONE)


#: The flag transformers' init functions check to leave a tensor alone.
_HF_DONE = "_is_hf_initialized"


def _hf_init_chain(modules: dict[str, nn.Module], name: str) -> list[tuple[nn.Module, nn.Module]]:
    """(model, module) pairs for HF's ``_init_weights``: the module named ``name`` then each ancestor, nearest
    first, each with the nearest Hugging Face ``PreTrainedModel`` at or above it; empty outside such a model."""
    names = [name]
    while names[-1]:
        names.append(names[-1].rpartition(".")[0])
    chain = []
    for i, target in enumerate(names):
        owner = next((modules[n] for n in names[i:] if n in modules and _is_hf_model(modules[n])), None)
        if owner is not None and target in modules:
            chain.append((owner, modules[target]))
    return chain


def _is_hf_model(module: nn.Module) -> bool:
    return callable(getattr(module, "_init_weights", None)) and any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.") for cls in type(module).__mro__
    )


def _replace(tensor: torch.Tensor, data: torch.Tensor) -> None:
    """Give ``tensor`` (the same Python object: optimizers and tied modules keep their references) ``data``,
    across devices (``.data =`` cannot move a tensor off the meta device)."""
    new = nn.Parameter(data, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data
    torch.utils.swap_tensors(tensor, new)
