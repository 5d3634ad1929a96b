"""Loading the universal layout into any source, at any world size: validate everything, then read in place.

:func:`held_names` is what a rank can account for (its held names and tied aliases); the ranks gather these so
:func:`plan_load` can refuse a checkpoint holding a tensor no rank of this job has. :func:`plan_load` runs on each
rank alone, with no collectives: it resolves names (ties), checks every key, full shape and chunk coverage, the
files it needs, and the optimizer's groups and state, and returns a :class:`PendingLoad` whose ``fetch`` (a
collective) reads the boxes straight into the held tensors and the optimizer buffers, and whose ``apply`` loads the
optimizer and runs the source's hooks.

Nothing is staged beyond DCP's per-chunk read buffer: parameters are read into their own storage, and optimizer
state into the optimizer's current state tensors where it has them (resuming), else into fresh buffers.

An I/O error during ``fetch`` (a disk failing after validation; with ``verify=True`` every file's digest was
already checked) raises :class:`CorruptCheckpointError` on every rank and leaves the model, and the optimizer state
tensors it already had, partially read: load again or start from another checkpoint. The optimizer's settings,
scaler and RNG are untouched in that case.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardkit.checkpoint import safe_dcp, validate
from shardkit.checkpoint.errors import IncompatibleCheckpointError
from shardkit.checkpoint.metadata import IMPORTED_STRATEGY, CheckpointMeta
from shardkit.checkpoint.pending import PendingLoad
from shardkit.checkpoint.universal.layout import COMPILED_PREFIX, DCP_DIR
from shardkit.checkpoint.universal.optim_state import OptimizerLoadPlan, plan_optimizer_load
from shardkit.checkpoint.universal.placement import MODEL_PREFIX, Placement, model_key
from shardkit.checkpoint.universal.plans import UniversalLoadPlanner, check_pieces, pieces_for
from shardkit.checkpoint.universal.side import read_all
from shardkit.checkpoint.universal.source import Held, UniversalSource
from shardkit.checkpoint.universal.split import check_stored_fits
from shardkit.checkpoint.validate import Shape


def held_names(source: UniversalSource, held: list[Held]) -> list[str]:
    """Every name this rank accounts for: its spans' names and both sides of its ties."""
    names = {span.fqn for h in held for span in h.spans}
    for alias, target in source.aliases().items():
        names.update((alias, target))
    return sorted(names)


def stored_names(metadata: Metadata) -> set[str]:
    """The parameter and buffer names a universal store holds."""
    return {k[len(MODEL_PREFIX) :] for k in metadata.state_dict_metadata if k.startswith(MODEL_PREFIX)}


def name_resolver(aliases: dict[str, str], stored: set[str]) -> Callable[[str], str]:
    """Maps a name of this model to the name the checkpoint stores it under (a tie may be stored by either of its
    names; earlier shardkit versions stored a compiled model's names behind ``_orig_mod.``); a name the
    checkpoint lacks maps to itself."""
    tied: dict[str, set[str]] = {}
    for alias, target in aliases.items():
        group = tied.get(alias, {alias}) | tied.get(target, {target})
        for name in group:
            tied[name] = group

    def resolve(name: str) -> str:
        if name in stored:
            return name
        if COMPILED_PREFIX + name in stored:
            return COMPILED_PREFIX + name
        return next((other for other in sorted(tied.get(name, ())) if other in stored), name)

    return resolve


def check_model_keys(
    directory: Path, metadata: Metadata, held: list[Held], resolve: Callable[[str], str], job_names: set[str]
) -> None:
    """This rank's names and full shapes against the store; stored names no rank of the job holds are unexpected."""
    expected: dict[str, Shape] = {}
    for h in held:
        for span in h.spans:
            expected[resolve(span.fqn)] = tuple(span.shape)
            stored = metadata.state_dict_metadata.get(model_key(resolve(span.fqn)))
            if span.split is not None and isinstance(stored, TensorStorageMetadata):
                check_stored_fits(span.fqn, stored.size, span.shape, span.split)
    given: dict[str, Shape] = {}
    for key, entry in metadata.state_dict_metadata.items():
        name = key[len(MODEL_PREFIX) :]
        if key.startswith(MODEL_PREFIX) and (name in expected or name not in job_names):
            given[name] = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
    validate.check_model_state(expected, given, f"the model state in {directory}")


def plan_load(
    directory: Path,
    meta: CheckpointMeta,
    source: UniversalSource,
    held: list[Held],
    job_names: set[str],
    rank: int,
    group: Optional[dist.ProcessGroup] = None,
) -> PendingLoad:
    """Validate this rank's part of the checkpoint against ``source`` and plan reading it; changes nothing.

    ``job_names`` is the union of :func:`held_names` over the ranks of the loading job."""
    store = directory / DCP_DIR
    metadata = safe_dcp.read_metadata(store)
    resolve = name_resolver(source.aliases(), stored_names(metadata))
    check_model_keys(directory, metadata, held, resolve, job_names)
    placements: list[Placement] = []
    what: dict[str, str] = {}
    for h in held:
        for span in h.spans:
            key = model_key(resolve(span.fqn))
            placements.append(
                Placement(
                    key, span.shape, h.tensor.dtype, span.start, span.stop, h.tensor, span.local_offset, span.split
                )
            )
            what[key] = f"parameter or buffer '{span.fqn}'"
    optimizer_plan: Optional[OptimizerLoadPlan] = None
    optimizer = source.local_optimizer()
    if optimizer is not None and not meta.has_optimizer and meta.strategy == IMPORTED_STRATEGY:
        # Weights from another tool: nothing to restore, the caller's fresh optimizer is the starting point.
        warnings.warn(
            f"{directory} was made by `shardkit checkpoint import` and holds weights only: the model is loaded, the "
            "optimizer starts afresh",
            stacklevel=2,
        )
        optimizer = None
    if optimizer is not None:
        if not meta.has_optimizer:
            raise IncompatibleCheckpointError(
                f"{directory} holds no optimizer state (it was saved without an optimizer); load it with "
                "optimizer=None and start the optimizer afresh"
            )
        optimizer_plan = plan_optimizer_load(source, held, optimizer, metadata, read_all(directory), resolve)
        placements += optimizer_plan.placements
        what.update(optimizer_plan.what)
    pieces = pieces_for(placements)
    check_pieces(pieces, metadata, store, what)
    after_extra = source.read_extra(directory, meta, rank)

    def fetch() -> None:
        if optimizer_plan is not None:
            optimizer_plan.prepare()
        safe_dcp.load_planned(store, UniversalLoadPlanner(pieces), group)

    def apply() -> None:
        if optimizer_plan is not None:
            source.load_optimizer(optimizer_plan.state_dict())
        if after_extra is not None:
            after_extra()
        source.after_load()

    return PendingLoad(apply=apply, fetch=fetch)
