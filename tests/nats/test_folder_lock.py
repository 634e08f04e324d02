"""One writer per folder: the lock refuses a second holder and dies with its holder."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nats.folder_lock import FolderBusy, exclusive, writing_into


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


def test_writing_into_leaves_no_lock_file_and_no_new_empty_folders(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    with writing_into(out, "report folder") as held:
        (held / "report.html").write_text("done")
        with pytest.raises(FolderBusy, match=f"in use by process {os.getpid()}"), \
                exclusive(out):
            pass
    assert sorted(p.name for p in out.iterdir()) == ["report.html"]
    failed = tmp_path / "c" / "d"
    with pytest.raises(RuntimeError), writing_into(failed, "export folder"):
        raise RuntimeError("the write failed")
    assert not (tmp_path / "c").exists()  # both folders it made, removed again
    with writing_into(tmp_path, "folder"):  # an existing folder stays, even empty
        pass
    assert tmp_path.is_dir() and not (tmp_path / ".lock").exists()
