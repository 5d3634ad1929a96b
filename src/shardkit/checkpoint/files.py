"""Durable file writes and safe reads: fsync before rename, digests, and ``torch.load(weights_only=True)`` only.

A file that ``torch.load(weights_only=True)`` refuses (it names a class or function to rebuild, which could run
code) raises :class:`~shardkit.checkpoint.errors.UnsafeCheckpointError` without executing anything; a file that
is truncated or damaged raises :class:`~shardkit.checkpoint.errors.CorruptCheckpointError`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import resource
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch

from shardkit.checkpoint.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError

_CHUNK = 1 << 20


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable. Best effort where the OS cannot open directories."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_torch(path: Path, obj: Any) -> None:
    """``torch.save`` ``obj`` to ``path`` and fsync it (the directory is made durable by the caller)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except Exception as err:
        raise write_failure(path, err) from err


def write_failure(path: Path, err: BaseException) -> CheckpointError:
    """The error for a failed write of ``path``: the file and the OS-level cause, not the serialiser's symptom.

    A write that the OS cuts short (file-size limit, full disk, Ctrl-C) surfaces from ``torch.save`` as "[enforce
    fail at inline_container.cc] unexpected pos", with the real cause only in the exception's context; this finds
    it there, or failing that asks the OS (the file-size limit, the free space) what stopped the write."""
    return CheckpointError(f"writing {path} failed: {_write_cause(path, err)}")


def _write_cause(path: Path, err: BaseException) -> str:
    chain: list[BaseException] = []
    link: Optional[BaseException] = err
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    for link in chain:
        if isinstance(link, KeyboardInterrupt):
            return "interrupted by SIGINT (Ctrl-C, or the launcher stopping the job)"
        if isinstance(link, OSError) and link.errno is not None:
            return _os_error(path, link.errno)
    size_limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if size_limit != resource.RLIM_INFINITY and path.is_file() and path.stat().st_size >= size_limit:
        return _os_error(path, errno.EFBIG)
    with contextlib.suppress(OSError):
        if os.statvfs(path.parent).f_bavail == 0:
            return _os_error(path, errno.ENOSPC)
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"


def _os_error(path: Path, code: int) -> str:
    said = f"{errno.errorcode.get(code, code)} ({os.strerror(code)})"
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return f"{said}: the process's file-size limit (ulimit -f, RLIMIT_FSIZE) is {limit} bytes"
        return f"{said}: the filesystem's largest file size was reached"
    if code in (errno.ENOSPC, errno.EDQUOT):
        with contextlib.suppress(OSError):
            stats = os.statvfs(path.parent)
            return f"{said}: {stats.f_bavail * stats.f_frsize} bytes free on the filesystem of {path.parent}"
    return said


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON through a temporary file, fsync, rename: readers see the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def safe_load(path: Path, what: str) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, with errors that say which file and what to do.

    Example::

        state = safe_load(Path("ckpt/model.pt"), "model state")
    """
    if not path.is_file():
        raise CorruptCheckpointError(f"{what}: {path} is missing; the checkpoint is incomplete or was moved")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        refusal = _refusal(str(err))
        if refusal is not None:
            raise UnsafeCheckpointError(
                f"{what}: {path} holds pickled Python objects that torch.load(weights_only=True) refuses (they "
                "could run code when loaded), so it was not loaded. shardkit checkpoints hold only tensors and "
                f"plain data; do not load files of unknown origin. ({refusal})"
            ) from None
        raise _corrupt(path, what, err) from err
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, KeyError, AttributeError) as err:
        raise _corrupt(path, what, err) from err


def _refusal(message: str) -> Optional[str]:
    """What torch's weights-only unpickler refused (the line naming it), or ``None`` if it refused nothing."""
    if "Weights only load failed" not in message and "WeightsUnpickler" not in message:
        return None
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "nsupported" in line or "unrecognized" in line]
    return (named or lines)[0]


def _corrupt(path: Path, what: str, err: BaseException) -> CorruptCheckpointError:
    first_line = (str(err).splitlines() or [type(err).__name__])[0]
    return CorruptCheckpointError(
        f"{what}: {path} cannot be read ({type(err).__name__}: {first_line}); the file is truncated or damaged. "
        "Load an earlier checkpoint (shardkit.checkpoint.latest_checkpoint skips incomplete ones)."
    )


def check_weights_only(obj: Any, what: str) -> None:
    """Raise a ValueError now if ``obj`` could not be read back with ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as err:
        raise ValueError(
            f"{what} must hold only tensors, numbers, strings, booleans, None and lists/tuples/dicts of them (what "
            f"torch.load(weights_only=True) reads back), got {type(obj).__name__}: {str(err).splitlines()[0]}"
        ) from None
