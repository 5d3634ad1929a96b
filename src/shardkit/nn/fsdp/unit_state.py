"""The state machine of a wrapped unit: where it is in the training step and which events may move it on.

Every state change of a :class:`~shardkit.nn.fsdp.runtime.Unit` goes through :func:`check_event`, which refuses
an event from a state it may not start from with an error naming the unit, its state and what to do (the hints
below). The table is the whole machine; the unit applies the result (and keeps the state to resume after a
forward run again inside backward). Example::

    check_event("blocks.3", TrainingState.SUMMON_FULL_PARAMS, "pre_backward")   # raises, saying why
    assert check_event("blocks.3", TrainingState.IDLE, "summon") is TrainingState.SUMMON_FULL_PARAMS
"""

from __future__ import annotations

import enum
from typing import Optional


class TrainingState(enum.Enum):
    """Where a wrapped unit is in the training step."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


_S = TrainingState
#: The states of a unit inside a backward pass.
IN_BACKWARD = frozenset({_S.BACKWARD_PRE, _S.BACKWARD_POST})
#: event -> (states it may start from, state it leads to). Every state change goes through :func:`check_event`.
_TRANSITIONS: dict[str, tuple[frozenset[TrainingState], Optional[TrainingState]]] = {
    # forward inside backward happens when activation checkpointing recomputes a unit; the state is kept.
    "pre_forward": (frozenset({_S.IDLE}) | IN_BACKWARD, _S.FORWARD),
    "post_forward": (frozenset({_S.FORWARD}), None),  # back to the state before pre_forward
    "pre_backward": (frozenset({_S.IDLE}) | IN_BACKWARD, _S.BACKWARD_PRE),
    "post_backward": (frozenset({_S.IDLE}) | IN_BACKWARD, _S.BACKWARD_POST),
    "finish_backward": (frozenset({_S.IDLE}) | IN_BACKWARD, _S.IDLE),
    "summon": (frozenset({_S.IDLE}), _S.SUMMON_FULL_PARAMS),
    "unsummon": (frozenset({_S.SUMMON_FULL_PARAMS}), _S.IDLE),
    # a forward or backward that raised without being undone (see Unit.abandon): whatever the state, start over.
    "abandon": (frozenset(_S), _S.IDLE),
}

_HINTS = {
    _S.FORWARD: "it is still inside its forward (a module reached through itself, or backward called inside forward)",
    _S.SUMMON_FULL_PARAMS: (
        "it is inside summon_full_params(); run training forward/backward outside that context (a forward "
        "without gradients, e.g. under torch.no_grad() or generate(), may run inside it)"
    ),
    _S.BACKWARD_PRE: "it is inside backward; call this after loss.backward() has returned",
    _S.BACKWARD_POST: "it is inside backward; call this after loss.backward() has returned",
    _S.IDLE: "it is idle",
}


def check_event(unit_name: str, state: TrainingState, event: str) -> Optional[TrainingState]:
    """Raise an error naming unit ``unit_name``, its ``state`` and what to do unless ``event`` may start from
    ``state``; else the state it leads to (None: the state before the forward, which the unit keeps)."""
    sources, target = _TRANSITIONS[event]
    if state not in sources:
        raise RuntimeError(
            f"FullyShardedDataParallel unit '{unit_name}' cannot {event.replace('_', ' ')} while in state "
            f"{state.name}: {_HINTS[state]}."
        )
    return target


def may_start(event: str, state: TrainingState) -> bool:
    """True when ``event`` may start from ``state``."""
    return state in _TRANSITIONS[event][0]


def state_hint(state: TrainingState) -> str:
    """What a unit in ``state`` is doing, for error messages (``it is inside backward; ...``)."""
    return _HINTS[state]
