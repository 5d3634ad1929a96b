"""Test-facing name for the reference models, which live in :mod:`shardkit.models`; this module re-exports them
(the same names, from the one list in ``shardkit.models.__all__``)."""

from shardkit.models import *  # noqa: F403
from shardkit.models import __all__ as __all__
