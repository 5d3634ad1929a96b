"""Frozen settings of SlowMo data parallelism, one small dataclass per component.

:class:`~shardkit.nn.slowmo.api.SlowMoDistributedDataParallel` keeps fairscale's 28-argument constructor so users
migrate by changing an import; :func:`configs_from_arguments` turns those arguments into the dataclasses below at
once, and the components only ever see the dataclasses. Each dataclass checks its own fields in ``__post_init__``
(errors name the constructor argument), so no invalid config can be built, also not by ``dataclasses.replace``.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import Optional, Union

import torch


class SlowMoBaseAlgorithm(str, enum.Enum):
    """How nodes approximately agree on parameters between slow-momentum steps.

    ``LOCALSGD`` averages the parameters exactly every ``localsgd_frequency`` steps (Lin et al., 2018);
    ``SGP`` (Stochastic Gradient Push, Assran et al., 2019) mixes them with a few peers every step along a gossip
    graph.
    """

    LOCALSGD = "localsgd"
    SGP = "sgp"

    @classmethod
    def parse(cls, value: Union[SlowMoBaseAlgorithm, str]) -> SlowMoBaseAlgorithm:
        """Accept the enum or its string value (fairscale's older spelling), case-insensitively."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower():
                    return member
        choices = ", ".join(f"SlowMoBaseAlgorithm.{m.name}" for m in cls)
        raise ValueError(f"unknown slowmo_base_algorithm {value!r}; use one of {choices}")


@dataclass(frozen=True)
class SlowMomentumConfig:
    """The outer (slow-momentum) step, run every ``frequency`` steps.

    With ``x_avg`` the exact average over all ranks, ``gamma`` the base optimizer's learning rate and ``x0`` the
    parameters at the start of the outer iteration: ``u <- momentum*u + (x0 - x_avg)/gamma`` and
    ``x <- x0 - lr*gamma*u``.
    """

    #: beta: how much of the previous slow-momentum buffer survives each outer step.
    momentum: float = 0.5
    #: alpha: the slow learning rate; 1.0 with momentum 0 makes the outer step a plain exact average.
    lr: float = 1.0
    #: Steps between outer steps.
    frequency: int = 48
    #: Shard ``u`` and ``x0`` over ``num_shards`` ranks instead of keeping both on every rank.
    memory_efficient: bool = True
    #: Ranks holding a shard (already capped at the world size).
    num_shards: int = 32

    def __post_init__(self) -> None:
        _positive_int("slowmo_frequency", self.frequency)
        _positive_int("slowmo_num_shards", self.num_shards)
        if not self.lr > 0:
            raise ValueError(f"slowmo_lr must be > 0, got {self.lr!r}")
        if not self.momentum >= 0:
            raise ValueError(f"slowmo_momentum must be >= 0, got {self.momentum!r}")
        _check_bool("slowmo_memory_efficient", self.memory_efficient)

    @property
    def enabled(self) -> bool:
        """False when ``lr == 1`` and ``momentum == 0``: the outer step would only average, which is skipped."""
        return self.lr != 1.0 or self.momentum != 0.0


@dataclass(frozen=True)
class LocalSGDConfig:
    """Exact averaging of the parameters across nodes every ``frequency`` steps."""

    #: Steps between averages.
    frequency: int = 3

    def __post_init__(self) -> None:
        _positive_int("localsgd_frequency", self.frequency)


@dataclass(frozen=True)
class GossipConfig:
    """Stochastic Gradient Push between nodes."""

    #: True: push-sum (column-stochastic mixing, a weight travels with every message and de-biases the
    #: parameters). False: push-pull (doubly stochastic mixing, needs a regular graph and uniform mixing; no weight).
    push_sum: bool = True
    #: Start each round's exchange asynchronously and add what it received at a later step (see ``synch_freq``).
    overlap: bool = False
    #: With ``overlap``: 0 or 1 adds each round's messages at the next step; ``s >= 2`` waits for all rounds in
    #: flight only every ``s`` steps (up to ``s`` rounds, each holding a copy of the parameters, in flight).
    synch_freq: int = 0
    #: With ``overlap`` and CUDA parameters: prepare and issue messages on a side CUDA stream.
    use_streams: bool = True
    #: With slow momentum off: replace the gossip round by an exact average every ``slowmo_frequency`` steps.
    #: (With slow momentum on, every slow-momentum step already uses the exact average.)
    average_params_on_slowmo: bool = False

    def __post_init__(self) -> None:
        _positive_int("synch_freq", self.synch_freq, minimum=0)
        for name, value in (
            ("push_sum", self.push_sum),
            ("overlap", self.overlap),
            ("use_streams", self.use_streams),
            ("slowmo_sgp_average_params", self.average_params_on_slowmo),
        ):
            _check_bool(name, value)

    @property
    def sync_every(self) -> int:
        """Steps between waits for the rounds in flight (1 for ``synch_freq`` 0 or 1)."""
        return max(1, self.synch_freq)


@dataclass(frozen=True)
class WrapperConfig:
    """What the wrapper itself does around the components."""

    #: LocalSGD or SGP between nodes.
    base_algorithm: SlowMoBaseAlgorithm = SlowMoBaseAlgorithm.LOCALSGD
    #: Broadcast module buffers from global rank 0 before every forward.
    broadcast_buffers: bool = True
    #: Where communication buffers live (None: CPU for gloo, the parameters' device otherwise).
    comm_device: Optional[torch.device] = None
    #: Log every step's plan at DEBUG level.
    verbose: bool = False
    #: Time every phase of ``perform_slowmo`` and log the timings.
    profile_mode: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.base_algorithm, SlowMoBaseAlgorithm):
            raise TypeError(
                f"WrapperConfig.base_algorithm must be a SlowMoBaseAlgorithm, got {self.base_algorithm!r} "
                "(SlowMoBaseAlgorithm.parse accepts the string spellings)"
            )
        if self.comm_device is not None and not isinstance(self.comm_device, torch.device):
            raise TypeError(f"comm_device must be a torch.device or None, got {self.comm_device!r}")
        for name, value in (
            ("broadcast_buffers", self.broadcast_buffers),
            ("verbose", self.verbose),
            ("profile_mode", self.profile_mode),
        ):
            _check_bool(name, value)


@dataclass(frozen=True)
class SlowMoConfig:
    """All settings of one wrapper."""

    #: What the wrapper does around the components.
    wrapper: WrapperConfig
    #: The outer step.
    slow_momentum: SlowMomentumConfig
    #: Exact averaging between nodes (LocalSGD).
    local_sgd: LocalSGDConfig
    #: Gossip between nodes (SGP).
    gossip: GossipConfig

    def __post_init__(self) -> None:
        for name, value, kind in (
            ("wrapper", self.wrapper, WrapperConfig),
            ("slow_momentum", self.slow_momentum, SlowMomentumConfig),
            ("local_sgd", self.local_sgd, LocalSGDConfig),
            ("gossip", self.gossip, GossipConfig),
        ):
            if not isinstance(value, kind):
                raise TypeError(f"SlowMoConfig.{name} must be a {kind.__name__}, got {type(value).__name__}")


def _positive_int(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _number(name: str, value: float) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def configs_from_arguments(
    *,
    world_size: int,
    slowmo_base_algorithm: Union[SlowMoBaseAlgorithm, str],
    broadcast_buffers: bool,
    slowmo_momentum: float,
    slowmo_memory_efficient: bool,
    slowmo_frequency: int,
    slowmo_lr: float,
    slowmo_num_shards: int,
    localsgd_frequency: int,
    push_sum: bool,
    overlap: bool,
    synch_freq: int,
    use_streams: bool,
    slowmo_sgp_average_params: bool,
    verbose: bool,
    profile_mode: bool,
    comm_device: Optional[Union[torch.device, str]],
) -> SlowMoConfig:
    """Group the constructor's arguments into frozen configs, which check them (raises before anything is built)."""
    algorithm = SlowMoBaseAlgorithm.parse(slowmo_base_algorithm)
    local_sgd = LocalSGDConfig(frequency=localsgd_frequency)
    # Checked before it is capped at the world size, so the error shows the value that was passed.
    num_shards = min(world_size, _positive_int("slowmo_num_shards", slowmo_num_shards))
    slow = SlowMomentumConfig(
        momentum=_number("slowmo_momentum", slowmo_momentum),
        lr=_number("slowmo_lr", slowmo_lr),
        frequency=slowmo_frequency,
        memory_efficient=bool(slowmo_memory_efficient),
        num_shards=num_shards,
    )
    if algorithm is SlowMoBaseAlgorithm.LOCALSGD and slow.enabled and slowmo_frequency % localsgd_frequency != 0:
        warnings.warn(
            f"slowmo_frequency={slowmo_frequency} is not a multiple of localsgd_frequency={localsgd_frequency}: "
            "slow-momentum steps that do not coincide with a LocalSGD average need an extra exact average (and "
            "with slowmo_memory_efficient the LocalSGD average is skipped on slow-momentum steps). Set "
            "slowmo_frequency to a multiple of localsgd_frequency.",
            UserWarning,
            stacklevel=4,
        )
    device = torch.device(comm_device) if comm_device is not None else None
    return SlowMoConfig(
        wrapper=WrapperConfig(algorithm, bool(broadcast_buffers), device, bool(verbose), bool(profile_mode)),
        slow_momentum=slow,
        local_sgd=local_sgd,
        gossip=GossipConfig(
            push_sum=bool(push_sum),
            overlap=bool(overlap),
            synch_freq=synch_freq,
            use_streams=bool(use_streams),
            average_params_on_slowmo=bool(slowmo_sgp_average_params),
        ),
    )
