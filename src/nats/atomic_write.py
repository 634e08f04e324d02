"""Atomic file writes: a crash leaves either the old file or the new one, never half."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


def _process_umask() -> int:
    """The umask, read from ``/proc`` where it can be (setting it to read it back would
    give another thread's files mode 0666 for that moment), else set and restored once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _process_umask()


def check_output_file(path: str | Path, option: str = "--out") -> None:
    """Refuse, before any work, an output path that cannot be a file (a folder): a long
    evaluation should not end in an error at its last write."""
    if Path(path).is_dir():
        raise IsADirectoryError(f"{option} {path} is a folder: give a file name")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers never see a partial file.

    The data goes to a temporary file beside ``path``, is flushed to disk and renamed over
    it; the folder is then flushed too, so the rename survives a power cut. The file gets
    the permissions an ordinary ``open`` would give (``0666`` less the umask; the
    temporary file's are ``0600``). Temporary files that a killed writer of the same
    ``path`` left behind are removed first: callers hold the folder
    (:mod:`nats.folder_lock`) or are its only writer.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some network and FUSE file systems cannot sync a folder
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)
