"""Tune and Optuna state that follows its search folder when the folder is copied or moved.

Ray Tune pickles the search algorithm into ``DIR/tune`` (``tuner.pkl``,
``searcher-state-*.pkl``, ``search_gen_state-*.json``), and ``Tuner.restore`` unpickles it
as it was. Two things in it named the folder by its absolute path, so resuming a copy
wrote to the original (or failed with ENOENT once the original was gone):

- the Optuna study's journal file, inside the storage that ``OptunaSearch`` keeps: here a
  :class:`FolderJournal`, pickled by its path inside the folder and reopened in the folder
  being resumed;
- the storage of the Tune experiment that :class:`FolderSearch` makes new trials from:
  re-pointed to the folder being resumed after each restore (Tune re-points the trials it
  restores, but not this one).

Which folder that is comes from :func:`searching`, which the search driver holds while Tune
runs; Tune's own paths (``storage_path``, the trials' checkpoints) follow the path given
to ``Tuner.restore``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from optuna.storages.journal import JournalFileBackend
from ray.tune.search import SearchGenerator

_FOLDER: ContextVar[Path] = ContextVar("nats_search_folder")


@contextlib.contextmanager
def searching(folder: Path) -> Iterator[None]:
    """Say that the Tune state unpickled inside the ``with`` block belongs to ``folder``
    (absolute), the search folder this driver runs or resumes."""
    token = _FOLDER.set(folder)
    try:
        yield
    finally:
        _FOLDER.reset(token)


def _folder() -> Path:
    try:
        return _FOLDER.get()
    except LookupError:
        raise RuntimeError("a search's Tune state is restored by `nats search --resume DIR` "
                           "(search.resume_search), which says which folder it is in") from None


class FolderJournal(JournalFileBackend):
    """An Optuna journal file inside the search folder, pickled by its path in the folder
    (``name``), so that the searcher Tune restores writes the journal of the folder being
    resumed, not that of the folder it was saved in."""

    def __init__(self, folder: Path, name: str) -> None:
        super().__init__(str(folder / name))
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return _reopen_journal, (self.name,)


def _reopen_journal(name: str) -> FolderJournal:
    return FolderJournal(_folder(), name)


class FolderSearch(SearchGenerator):
    """Tune's search algorithm (a ``SearchGenerator``) whose restored experiment is
    re-pointed to the folder being resumed: its pickled storage names the folder it was
    saved in, and the trials it makes after a restore would keep their Tune state (results,
    checkpoints) there."""

    def restore_from_dir(self, dirpath: str) -> None:
        super().restore_from_dir(dirpath)
        self._experiment.storage.storage_fs_path = _folder().as_posix()
