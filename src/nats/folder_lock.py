"""One writer per folder: an exclusive OS lock on a run or search folder.

Two processes writing one run folder leave a mix of both (the config of one, the
checkpoints of the other, interleaved event files). The lock is ``flock`` on
``FOLDER/.lock``, which the OS releases when the holder dies however it dies, so a
killed run never leaves the folder locked; the file records the holder's pid for the
message a second writer gets.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".lock"


class FolderBusy(OSError):
    """Another live process holds the folder."""


@contextlib.contextmanager
def exclusive(folder: str | Path, what: str = "folder") -> Iterator[Path]:
    """Hold ``folder`` (created if absent) for the ``with`` block; a second holder, in this
    or another process, gets :class:`FolderBusy` naming the first one's pid."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise FolderBusy(f"{what} {folder} is in use by process {holder}; wait for it "
                             "to finish or choose another folder") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield folder
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def writing_into(folder: str | Path, what: str) -> Iterator[Path]:
    """Hold ``folder`` (:func:`exclusive`) while a result is written into it: its lock file
    is removed at the end while still held (no other writer can be using it), and the
    folders this call created are removed again if left empty, so a failed write leaves
    no new folders."""
    folder = Path(folder)
    created = [p for p in (folder, *folder.parents) if not p.exists()]  # innermost first
    try:
        with exclusive(folder, what):
            try:
                yield folder
            finally:
                (folder / LOCK_FILE).unlink(missing_ok=True)
    finally:
        for path in created:
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
