"""Command-line output into a pipe whose reader stops early (``shardkit checkpoint inspect DIR | head``)."""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

#: The exit status of a command stopped by a closed pipe (128 + SIGPIPE), as shells report ``yes | head``.
BROKEN_PIPE_STATUS = 141


def quiet_on_broken_pipe(main: Callable[..., int]) -> Callable[..., int]:
    """Make a command's ``main`` stop quietly with status 141 when its reader closes the pipe, instead of printing
    a ``BrokenPipeError`` traceback (and another one when Python flushes stdout at exit).

    Example::

        @quiet_on_broken_pipe
        def main(argv=None) -> int:
            ...
    """

    @functools.wraps(main)
    def run(*args: object, **kwargs: object) -> int:
        try:
            status = main(*args, **kwargs)
            sys.stdout.flush()
            return status
        except BrokenPipeError:
            # Nothing more can reach the reader; point stdout at devnull so the flush at exit does not raise again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return BROKEN_PIPE_STATUS

    return run
