"""One writer per folder: the lock refuses a second holder and dies with its holder."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nats.folder_lock import FolderBusy, exclusive


def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    busy = rf"run folder .*run is in use by process {os.getpid()}; wait"
    with exclusive(tmp_path / "run", "run folder"), pytest.raises(FolderBusy, match=busy), \
            exclusive(tmp_path / "run", "run folder"):
        pass
    with exclusive(tmp_path / "run"):  # released at the end of the block
        pass


def test_the_lock_goes_with_a_killed_holder(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from nats.folder_lock import exclusive\n"
         f"with exclusive({str(tmp_path)!r}):\n    print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    with pytest.raises(FolderBusy, match=f"process {holder.pid}"), exclusive(tmp_path):
        pass
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with exclusive(tmp_path):
        pass
