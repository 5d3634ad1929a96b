"""Field checks shared by the settings dataclasses of the tools (benchmarks, demo, reference models).

Each raises ``ValueError`` naming the class and field, so a bad value is refused when the settings are built
(also by ``dataclasses.replace``), not steps later inside a worker process.
"""

from __future__ import annotations


def at_least(owner: object, name: str, value: float, minimum: float) -> None:
    """Refuse ``value`` below ``minimum`` (and non-numbers) for field ``name`` of ``owner``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ValueError(f"{type(owner).__name__}.{name} must be at least {minimum}, got {value!r}")


def positive(owner: object, name: str, value: float) -> None:
    """Refuse ``value`` that is not a number > 0 for field ``name`` of ``owner``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{type(owner).__name__}.{name} must be > 0, got {value!r}")


__all__ = ["at_least", "positive"]
