"""A stand-in process group for building and testing wrapped models without ``init_process_group``."""

from __future__ import annotations


class DummyProcessGroup:
    """A process group of one rank that needs no initialised ``torch.distributed``.

    Wrappers accept it wherever they accept a real group. With ``size == 1`` every collective is the identity,
    so a model wrapped with it trains exactly like the unwrapped model. A size above one lets users inspect how
    a model *would* be sharded (for example the shapes of local shards) without launching processes; running
    collectives on such a group raises.

    Example::

        group = DummyProcessGroup(rank=0, size=1)
        with enable_wrap(wrapper_cls=FSDP, process_group=group):
            layer = wrap(torch.nn.Linear(5, 5))
    """

    def __init__(self, rank: int, size: int) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"DummyProcessGroup needs 0 <= rank < size, got rank={rank}, size={size}")
        self._rank = rank
        self._size = size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"DummyProcessGroup(rank={self._rank}, size={self._size})"
