"""The public packages the API reference documents, and the check that nothing public is left out.

To document a new public package, add one :class:`ApiPackage` line to :data:`PACKAGES` (the order is the order
of the reference's pages; a name exported by several packages is documented in full on the first, and linked from
the others). A package that is not for users goes in :data:`INTERNAL`, with the reason. ``check()`` (run by the
docs build and by ``tests/docs/test_api_registry.py``) fails on:

- a package under ``src/shardkit`` (or a fairscale compatibility path) that is in neither list;
- a class or function in a registered package's ``__all__`` without a docstring of its own;
- a name in :data:`FAIRSCALE_NAMES` that shardkit does not have.

This module imports nothing from Sphinx, so the test runs in a second without building the site.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


@dataclass(frozen=True)
class ApiPackage:
    """One page of the API reference: a module whose ``__all__`` is its public names."""

    module: str
    summary: str
    #: Where a module only re-exports fairscale's path, the page is a table of links (no second description).
    face: bool = False
    #: Being built by another change: the page appears once the module can be imported, and is skipped before.
    pending: bool = False


PACKAGES: Tuple[ApiPackage, ...] = (
    ApiPackage("shardkit", "The top-level package: what each sub-package holds."),
    ApiPackage("shardkit.optim", "ZeRO-1: the sharded optimizer and the shard-aware AMP loss scalers."),
    ApiPackage("shardkit.nn", "The data-parallel wrappers: ZeRO-2, ZeRO-3 (FSDP), SlowMo; wrapping helpers."),
    ApiPackage("shardkit.nn.wrap", "enable_wrap / wrap / auto_wrap and the auto-wrap policies."),
    ApiPackage("shardkit.nn.checkpoint", "Activation checkpointing and fairscale's checkpointing flags."),
    ApiPackage("shardkit.nn.fsdp", "FullyShardedDataParallel's package: its settings and the layout read model."),
    ApiPackage("shardkit.nn.fsdp.state_dict", "FSDP's state-dict and optimizer-state helpers."),
    ApiPackage("shardkit.nn.sharded_ddp", "ShardedDataParallel's package and its policies."),
    ApiPackage("shardkit.nn.slowmo", "SlowMo, LocalSGD, SGP and the gossip building blocks."),
    ApiPackage("shardkit.modelparallel", "The smp API: import shardkit.modelparallel as smp."),
    ApiPackage("shardkit.modelparallel.nn", "smp.nn: the Apex layer replacements and smp's layer names."),
    ApiPackage("shardkit.modelparallel.optimizers", "smp.optimizers: FusedNovoGrad and FusedLamb."),
    ApiPackage(
        "shardkit.modelparallel.nn.huggingface",
        "smp.nn.huggingface: Hugging Face state dicts to and from smp's.",
        pending=True,
    ),
    ApiPackage("shardkit.tensor_parallel", "Tensor parallelism: one layer split across processes."),
    ApiPackage("shardkit.tensor_parallel.hf", "Tensor-parallel plans for Hugging Face model families."),
    ApiPackage("shardkit.lightning", "Lightning strategies."),
    ApiPackage("shardkit.checkpoint", "Training checkpoints any strategy loads at any world size."),
    ApiPackage("shardkit.distributed", "Process groups, topology, labelled collectives and the rank checks."),
    ApiPackage("shardkit.distributed.device", "One device per process."),
    ApiPackage("shardkit.launch", "Starting local multi-process jobs from Python."),
    ApiPackage("shardkit.plan", "Planning a run: memory, traffic and step time before paying for it."),
    ApiPackage("shardkit.memory", "Per-rank tensor memory tracking."),
    ApiPackage("shardkit.models", "The reference models the demo, planner, benchmarks and tests share."),
    ApiPackage("shardkit.testing", "The multi-process test harness."),
    ApiPackage("shardkit.compat", "The list of fairscale compatibility paths."),
    # fairscale's import paths: tables of links to the objects above.
    ApiPackage("shardkit.optim.oss", "fairscale.optim.oss", face=True),
    ApiPackage("shardkit.optim.grad_scaler", "fairscale.optim.grad_scaler", face=True),
    ApiPackage("shardkit.nn.data_parallel", "fairscale.nn.data_parallel", face=True),
    ApiPackage("shardkit.nn.data_parallel.sharded_ddp", "fairscale.nn.data_parallel.sharded_ddp", face=True),
    ApiPackage(
        "shardkit.nn.data_parallel.fully_sharded_data_parallel",
        "fairscale.nn.data_parallel.fully_sharded_data_parallel",
        face=True,
    ),
    ApiPackage("shardkit.nn.data_parallel.fsdp_optim_utils", "fairscale.nn.data_parallel.fsdp_optim_utils", face=True),
    ApiPackage("shardkit.nn.data_parallel.gossip", "fairscale.experimental.nn.data_parallel.gossip", face=True),
    ApiPackage("shardkit.nn.misc", "fairscale.nn.misc", face=True),
    ApiPackage(
        "shardkit.nn.checkpoint.checkpoint_activations", "fairscale.nn.checkpoint.checkpoint_activations", face=True
    ),
    ApiPackage("shardkit.experimental.nn.data_parallel", "fairscale.experimental.nn.data_parallel", face=True),
    ApiPackage(
        "shardkit.experimental.nn.data_parallel.gossip", "fairscale.experimental.nn.data_parallel.gossip", face=True
    ),
    ApiPackage("shardkit.utils.testing", "fairscale.utils.testing", face=True),
    ApiPackage("shardkit.nn.model_parallel", "fairscale.nn.model_parallel", face=True),
)

#: Packages (and everything under them) that users do not import, with why.
INTERNAL: Dict[str, str] = {
    "shardkit.bench": "the benchmark suites behind `shardkit bench` (documented on the Benchmarks page)",
    "shardkit.demo": "the synthetic task behind `shardkit demo`",
    "shardkit.strategies": "the strategy registry the tools build through (see Architecture)",
    "shardkit.checkpoint.adapters": "per-strategy sources of the universal layout (internal)",
    "shardkit.checkpoint.tools": "the implementation of `shardkit checkpoint` (documented as a command)",
    "shardkit.checkpoint.universal": "the universal layout's implementation",
    "shardkit.optim.zero1": "OSS's implementation; users import shardkit.optim",
    "shardkit.modelparallel.tp": "smp's tensor-parallel implementation; its face is smp.tensor_parallelism, smp.nn",
    "shardkit.modelparallel.schedules": "smp's pipeline schedules as action lists; chosen by smp.init's pipeline key",
    "shardkit.modelparallel.pipeline": "the executors of smp's schedules; users call them through smp.step",
    "shardkit.modelparallel.partitioning": "how smp.DistributedModel decides its partition (trace, placement, plan)",
    "shardkit.modelparallel.building": "how smp.DistributedModel builds this rank's stage at the first step",
    "shardkit.modelparallel.checkpoints": "smp's checkpoint files; users call smp.save, smp.load, smp.save_checkpoint",
    "shardkit.modelparallel.sdp": "smp's sharded data parallelism on FSDP; turned on by sharded_data_parallel_degree",
    "shardkit.utils": "internal helpers; shardkit.utils.testing is fairscale's path (registered)",
    "shardkit.experimental": "fairscale's path prefix; the modules with names in them are registered",
    "shardkit.experimental.nn": "fairscale's path prefix",
    "shardkit.experimental.nn.data_parallel.gossip.utils": "fairscale's path for `communicate`, used internally",
    "shardkit.experimental.nn.data_parallel.gossip.distributed": "fairscale's module path; names on the gossip page",
    "shardkit.experimental.nn.data_parallel.gossip.gossiper": "fairscale's module path; names on the gossip page",
    "shardkit.experimental.nn.data_parallel.gossip.graph_manager": "fairscale's module path; names on the gossip page",
    "shardkit.experimental.nn.data_parallel.gossip.mixing_manager": "fairscale's module path; names on the gossip page",
    "shardkit.nn.misc.flatten_params_wrapper": "fairscale's module path for FlatParameter (on the nn.misc page)",
}

#: fairscale 0.4.13's public names that shardkit provides: fairscale module -> (shardkit module, names).
FAIRSCALE_NAMES: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "fairscale.optim": ("shardkit.optim", ("OSS",)),
    "fairscale.optim.oss": ("shardkit.optim.oss", ("OSS",)),
    "fairscale.optim.grad_scaler": ("shardkit.optim.grad_scaler", ("GradScaler", "ShardedGradScaler")),
    "fairscale.nn": (
        "shardkit.nn",
        (
            "FullyShardedDataParallel",
            "ShardedDataParallel",
            "checkpoint_wrapper",
            "auto_wrap",
            "config_auto_wrap_policy",
            "default_auto_wrap_policy",
            "enable_wrap",
            "wrap",
        ),
    ),
    "fairscale.nn.data_parallel": (
        "shardkit.nn.data_parallel",
        (
            "FullyShardedDataParallel",
            "ShardedDataParallel",
            "TrainingState",
            "auto_wrap_bn",
            "get_fsdp_instances",
            "no_pre_load_state_dict_hook",
        ),
    ),
    "fairscale.nn.data_parallel.fully_sharded_data_parallel": (
        "shardkit.nn.data_parallel.fully_sharded_data_parallel",
        (
            "FullyShardedDataParallel",
            "ProcessGroupName",
            "TrainingState",
            "auto_wrap_bn",
            "get_fsdp_instances",
            "no_pre_load_state_dict_hook",
        ),
    ),
    "fairscale.nn.data_parallel.sharded_ddp": ("shardkit.nn.data_parallel.sharded_ddp", ("ShardedDataParallel",)),
    "fairscale.nn.wrap": (
        "shardkit.nn.wrap",
        ("ConfigAutoWrap", "auto_wrap", "config_auto_wrap_policy", "default_auto_wrap_policy", "enable_wrap", "wrap"),
    ),
    "fairscale.nn.checkpoint": ("shardkit.nn.checkpoint", ("checkpoint_wrapper",)),
    "fairscale.nn.checkpoint.checkpoint_activations": (
        "shardkit.nn.checkpoint.checkpoint_activations",
        (
            "checkpoint_wrapper",
            "disable_checkpointing",
            "enable_checkpointing",
            "enable_recomputing",
            "is_checkpointing",
            "is_recomputing",
        ),
    ),
    "fairscale.nn.misc": ("shardkit.nn.misc", ("FlattenParamsWrapper", "checkpoint_wrapper")),
    "fairscale.experimental.nn.data_parallel": (
        "shardkit.experimental.nn.data_parallel",
        ("SlowMoBaseAlgorithm", "SlowMoDistributedDataParallel"),
    ),
    "fairscale.utils.testing": ("shardkit.utils.testing", ("DummyProcessGroup",)),
    "fairscale.nn.model_parallel": (
        "shardkit.nn.model_parallel",
        (
            "vocab_parallel_cross_entropy",
            "get_data_parallel_group",
            "get_data_parallel_rank",
            "get_data_parallel_world_size",
            "get_model_parallel_group",
            "get_model_parallel_rank",
            "get_model_parallel_src_rank",
            "get_model_parallel_world_size",
            "initialize_model_parallel",
            "ColumnParallelLinear",
            "RowParallelLinear",
            "VocabParallelEmbedding",
            "copy_to_model_parallel_region",
            "gather_from_model_parallel_region",
            "get_cuda_rng_tracker",
            "model_parallel_cuda_manual_seed",
        ),
    ),
}

#: fairscale modules whose every public name shardkit's face exports (the face's ``__all__`` is fairscale's).
FAIRSCALE_WHOLE_MODULES: Dict[str, str] = {
    "fairscale.experimental.nn.data_parallel.gossip": "shardkit.experimental.nn.data_parallel.gossip",
    "fairscale.nn.data_parallel.fsdp_optim_utils": "shardkit.nn.data_parallel.fsdp_optim_utils",
}

SMP_MODULE = "smdistributed.modelparallel.torch"
_SMP_ROW = re.compile(r"^\| `smp\.([A-Za-z_][A-Za-z0-9_.]*)` \| (same|differs|refuses|missing|added) \|")


def public_names(module: Any) -> List[str]:
    """A module's public names: its ``__all__``, else what it defines (no leading underscore, not a module)."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return [name for name in names if name != "__version__"]
    found = []
    for name, value in vars(module).items():
        if name.startswith("_") or inspect.ismodule(value):
            continue
        if getattr(value, "__module__", module.__name__) == module.__name__:
            found.append(name)
    return sorted(found)


def import_registered(package: ApiPackage) -> Optional[Any]:
    """The module, or None for a pending package that does not exist yet."""
    try:
        return importlib.import_module(package.module)
    except ModuleNotFoundError as error:
        if package.pending and error.name is not None and package.module.startswith(error.name):
            return None
        raise


def source_packages() -> Iterator[str]:
    """Every package under src/shardkit, by dotted name."""
    for init in sorted((SRC / "shardkit").rglob("__init__.py")):
        parts = init.parent.relative_to(SRC).parts
        if any(part.startswith("_") for part in parts):
            continue
        yield ".".join(parts)


def _is_internal(module: str) -> bool:
    """Under an INTERNAL entry that covers its subtree, or a subpackage of a package still being built (pending:
    register its public subpackages once it lands)."""
    covering = [name for name in INTERNAL if _covers_subpackages(name)]
    covering += [package.module for package in PACKAGES if package.pending]
    return any(module.startswith(name + ".") or module == name for name in covering)


def _covers_subpackages(name: str) -> bool:
    """Entries whose whole subtree is internal (the fairscale path prefixes cover only themselves)."""
    return name not in {"shardkit.experimental", "shardkit.experimental.nn", "shardkit.utils"}


def smp_statuses() -> Dict[str, str]:
    """COMPATIBILITY.md's table of smp v1 names: name -> same / differs / refuses / missing / added."""
    text = (ROOT / "COMPATIBILITY.md").read_text()
    section = text.split("## smp (`import shardkit.modelparallel as smp`)", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = _SMP_ROW.match(line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def fairscale_aliases() -> Dict[int, List[str]]:
    """id(shardkit object) -> the fairscale dotted names it answers to."""
    found: Dict[int, List[str]] = {}
    entries = [(fs, sk, names) for fs, (sk, names) in FAIRSCALE_NAMES.items()]
    for fs, sk in FAIRSCALE_WHOLE_MODULES.items():
        entries.append((fs, sk, tuple(public_names(importlib.import_module(sk)))))
    for fs, sk, names in entries:
        module = importlib.import_module(sk)
        for name in names:
            found.setdefault(id(getattr(module, name)), []).append(f"{fs}.{name}")
    return found


def _undocumented(module: Any) -> List[str]:
    missing = []
    for name in public_names(module):
        value = getattr(module, name, None)
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        if not (value.__doc__ or "").strip():
            missing.append(f"{module.__name__}.{name}")
    return missing


def check() -> List[str]:
    """Every problem found, one line each (empty when the reference covers every public name)."""
    problems = []
    registered = {package.module for package in PACKAGES}
    from shardkit.compat import COMPAT_PATHS

    for name in [*source_packages(), *COMPAT_PATHS]:
        if name not in registered and name not in INTERNAL and not _is_internal(name):
            problems.append(
                f"package {name} is neither in the API reference nor marked internal: add "
                f'ApiPackage("{name}", "<one line>") to PACKAGES in docs/_ext/api_registry.py, or list it in INTERNAL'
            )
    for package in PACKAGES:
        module = import_registered(package)
        if module is None:
            continue
        for name in public_names(module):
            if not hasattr(module, name):
                problems.append(f"{package.module}.__all__ lists {name}, which the module does not have")
        problems.extend(f"{name} has no docstring" for name in _undocumented(module))
    for fs, (sk, names) in FAIRSCALE_NAMES.items():
        module = importlib.import_module(sk)
        problems.extend(f"{fs}.{name}: {sk} has no {name}" for name in names if not hasattr(module, name))
    return problems
