"""Replace the marked modules of a model by their distributed versions, when ``smp.DistributedModel`` wraps it.

The outermost module of a marked subtree whose class is registered (see :mod:`~.registry`) is replaced in its
parent; its subtree is not visited further. A marked module that cannot be split is kept as it is, and every such
module (no registered version, a size the degree does not divide, a weight shared with another module, constructor
arguments not recorded) is listed once in the log with the reason, never skipped silently. A marked Hugging Face model
of a family with a plan is split whole by the core's plan instead (see :mod:`~.hf`); the same one log message says
what each such model's plan keeps whole on every rank. Every rank holds the same model structure (checked first), so
every rank takes the same decisions.
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

from shardkit.distributed.model_check import check_same_model
from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.pipeline.grad_sync import SplitReduction
from shardkit.modelparallel.state import SMPState
from shardkit.modelparallel.tp import hf
from shardkit.modelparallel.tp.embedding import DistributedEmbedding
from shardkit.modelparallel.tp.layers import DistributedLinear, DistributedModule, split_divisor
from shardkit.modelparallel.tp.registry import Mark, Registration, init_args, mark_of, register, registration_for

LOG = logging.getLogger("shardkit.modelparallel")

register(nn.Linear, Registration(DistributedLinear))
register(nn.Embedding, Registration(DistributedEmbedding))


@dataclass
class Distribution:
    """What :func:`distribute` did: the replaced modules' names, and each marked module left unsplit with why."""

    replaced: list[str] = field(default_factory=list)
    hf_models: list[str] = field(default_factory=list)
    """The Hugging Face models split whole by their family's plan."""
    unsplit: list[tuple[str, str]] = field(default_factory=list)
    hf_whole: list[tuple[str, str]] = field(default_factory=list)
    """Per split Hugging Face model, what its plan leaves whole on every rank (see :func:`~.hf.left_whole`)."""

    def report(self) -> Optional[str]:
        """One log message listing the modules left unsplit, and what the split Hugging Face models keep whole
        (None when there is neither)."""
        parts = []
        if self.unsplit:
            lines = "; ".join(f"{name or '<model>'} ({why})" for name, why in self.unsplit)
            parts.append(f"{len(self.unsplit)} marked module(s) left unsplit: {lines}")
        parts += [f"Hugging Face model {name or '<model>'} split by its {whole}" for name, whole in self.hf_whole]
        return f"smp.tensor_parallelism: {' | '.join(parts)}" if parts else None


def distribute(root: nn.Module, state: Optional[SMPState] = None) -> Distribution:
    """Replace, in place, the outermost marked and registered modules below ``root``, and split the marked Hugging
    Face models (see the module docstring). ``state``: the smp job's (the current one when None)."""
    done = Distribution()
    uses = Counter(id(p) for _, p in root.named_parameters(remove_duplicate=False))
    mark = mark_of(root) or Mark(False)
    models: list[nn.Module] = []
    job = state if state is not None else smp_state.current()
    pending: list[tuple[nn.Module, str, nn.Module]] = []
    if not _take_hf_model(root, "", mark, job, done, models):  # a Hugging Face model taken whole is not visited
        if mark.enabled and registration_for(root) is not None:
            done.unsplit.append(("", "the model smp.DistributedModel wraps is never replaced itself; mark its parts"))
        elif mark.enabled and _holds_own_parameters(root):
            done.unsplit.append(("", f"no distributed version registered for {type(root).__name__}"))
        _visit(root, "", mark, uses, done, pending, (job, models))
    # Every replacement is built, and every refusal raised, before any is made: an error leaves the model as it was.
    for parent, name, built in pending:
        setattr(parent, name, built)
    for model in models:
        hf.split_model(model, job)
    return done


def _take_hf_model(
    module: nn.Module, path: str, mark: Mark, job: SMPState, done: Distribution, models: list[nn.Module]
) -> bool:
    """Whether ``module`` is a marked Hugging Face model with a plan, taken whole (its subtree is not visited) into
    ``models``, or listed unsplit with why. Raises for what is not built yet (see :mod:`~.hf`)."""
    if not (hf.is_hf_model(module) and hf.hf_marked(module, mark)):
        return False
    hf.refuse_unbuilt(module, path, job)
    why = hf.unsplit_reason(module, job.topology.tp_size)
    if why is None:
        models.append(module)
        done.hf_models.append(path)
        done.hf_whole.append((path, hf.left_whole(module, job.topology.tp_size)))
    else:
        done.unsplit.append((path, why))
    return True


def _holds_own_parameters(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values()) and not isinstance(module, DistributedModule)


def _visit(
    module: nn.Module,
    prefix: str,
    inherited: Mark,
    uses: Counter[int],
    done: Distribution,
    pending: list[tuple[nn.Module, str, nn.Module]],
    hf_models: tuple[SMPState, list[nn.Module]],
) -> None:
    for name, child in list(module.named_children()):
        path = prefix + name
        mark = mark_of(child) or inherited
        if isinstance(child, DistributedModule):  # already distributed, with its own plain parts inside
            continue
        if _take_hf_model(child, path, inherited, hf_models[0], done, hf_models[1]):
            continue
        if mark.enabled:
            registration = registration_for(child)
            if registration is not None:
                built, why = _build(child, registration, mark, uses)
                if built is not None:
                    pending.append((module, name, built))
                    done.replaced.append(path)
                    continue
                done.unsplit.append((path, why))
            elif _holds_own_parameters(child):
                done.unsplit.append((path, f"no distributed version registered for {type(child).__name__}"))
        _visit(child, path + ".", mark, uses, done, pending, hf_models)


def _build(
    module: nn.Module, registration: Registration, mark: Mark, uses: Counter[int]
) -> tuple[Optional[nn.Module], str]:
    """The distributed module replacing ``module``, or None and the reason it stays unsplit."""
    own = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    if any(uses[key] > count for key, count in own.items()):
        return None, "it shares a weight with another module"
    if any(p.is_meta for p in module.parameters()):
        raise NotImplementedError(
            f"smp tensor parallelism: {type(module).__name__} is on the meta device (delayed parameter "
            "initialization); distributing delayed modules is not built yet: set 'delayed_parameter_initialization': "
            "False, or build the model without smp.tensor_parallelism()"
        )
    try:
        if isinstance(module, nn.Linear) and registration.dist_module is DistributedLinear:
            return DistributedLinear.from_linear(module), ""
        if isinstance(module, nn.Embedding) and registration.dist_module is DistributedEmbedding:
            return DistributedEmbedding.from_embedding(module), ""
        return _construct(module, registration, mark)
    except ValueError as exc:  # a size the tensor-parallel degree does not divide
        return None, str(exc)


def _construct(module: nn.Module, registration: Registration, mark: Mark) -> tuple[Optional[nn.Module], str]:
    recorded = init_args(module)
    if recorded is None:
        return None, f"{type(module).__name__} was created before its class was registered with smp.tp_register"
    args, kwargs = recorded
    if registration.init_hook is not None:
        hooked = registration.init_hook(*args, **kwargs)
        args, kwargs = tuple(hooked[0]), dict(hooked[1])
    accepted = inspect.signature(registration.dist_module.__init__).parameters
    kwargs.update({key: value for key, value in mark.overrides.items() if key in accepted})
    built = registration.dist_module(*args, **kwargs)
    forward_hook, return_hook = registration.forward_hook, registration.return_hook
    if forward_hook is not None:

        def translate(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
            new_args, new_kwargs = forward_hook(*args, **kwargs)
            return tuple(new_args), dict(new_kwargs)

        built.register_forward_pre_hook(translate, with_kwargs=True)
    if return_hook is not None:
        built.register_forward_hook(lambda _, __, out: return_hook(out))
    return built, ""


def distribute_marked(root: nn.Module, state: SMPState) -> Distribution:
    """:func:`distribute` for ``smp.DistributedModel``: every rank first checks it holds the same model structure
    (so all take the same decisions), then replaces its marked modules; rank 0 logs the modules left unsplit."""
    if state.distributed:
        check_same_model(root, state.world_group, "smp.DistributedModel (tensor parallelism)")
    done = distribute(root, state)
    message = done.report()
    if message is not None and state.topology.rank == 0:
        LOG.warning(message)
    return done


def split_parameter_ids(root: nn.Module) -> frozenset[int]:
    """The parameters of the distributed modules and split Hugging Face models in ``root`` (reduced over the
    reduced-data-parallel group)."""
    own = frozenset(id(p) for m in root.modules() if isinstance(m, DistributedModule) for p in m.parameters())
    return own | hf.split_model_parameter_ids(root)


def split_reduction(root: nn.Module, state: SMPState) -> Optional[SplitReduction]:
    """How the split parameters' gradients are averaged (None without tensor parallelism)."""
    topo = state.topology
    if topo.tp_size == 1:
        return None
    divisor = split_divisor(topo.rdp_size, topo.tp_size, state.config.prescaled_batch)
    return SplitReduction(state.rdp_group, divisor, split_parameter_ids(root))
