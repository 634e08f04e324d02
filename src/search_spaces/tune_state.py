"""A keyed digest of a search's Ray Tune state, checked before ``Tuner.restore``.

``Tuner.restore`` unpickles files in ``DIR/tune`` (``tuner.pkl``, the searcher's state,
each trial's parameters), so resuming a folder that came from elsewhere could run any code
planted there. Every search this user runs signs that state when its driver stops, with
HMAC-SHA256 under a key only this user can read (``~/.config/nats/search-state.key``,
made on first use, mode 0600; ``NATS_STATE_KEY_FILE`` names another file); ``--resume``
restores only state that verifies. A folder whose driver was killed before it could sign
(kill -9, a lost node) is refused too; ``--trust-tune-state`` resumes it anyway, for a
folder you made yourself. Everything else a search folder holds is JSON, CSV,
safetensors or images, which nothing executes.

The digest covers each file's path relative to ``DIR/tune``, never where ``DIR`` is, so a
copied or moved folder still verifies.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import tempfile
from pathlib import Path

from nats.atomic_write import atomic_write_bytes

SIGNATURE_FILE = "tune_state.sig"


def key_file() -> Path:
    default = Path.home() / ".config" / "nats" / "search-state.key"
    return Path(os.environ.get("NATS_STATE_KEY_FILE", default))


KEY_BYTES = 32


def _key() -> bytes:
    """The user's key, made on first use: written whole to a private temporary file and
    linked into place, so two first uses at once agree on one key and none reads half."""
    path = key_file()
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".key.")  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):  # another made it first: use theirs
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise ValueError(f"{path} is not a search-state key ({len(key)} bytes, not "
                         f"{KEY_BYTES}); delete it to make a new one (searches signed with "
                         "the old key will then need --trust-tune-state)")
    return key


def _digest(tune_dir: Path) -> tuple[str, int]:
    """HMAC over every file of the Tune state (trainer checkpoints, plain safetensors that
    nothing unpickles, are left out): relative path, size and bytes, in path order."""
    mac = hmac.new(_key(), digestmod=hashlib.sha256)
    files = sorted(p for p in tune_dir.rglob("*") if p.is_file()
                   and p.suffix != ".safetensors")
    for path in files:
        data = path.read_bytes()
        mac.update(f"{path.relative_to(tune_dir).as_posix()}|{len(data)}|".encode())
        mac.update(data)
    return mac.hexdigest(), len(files)


def sign(tune_dir: Path, out: Path) -> None:
    """Record the digest of ``tune_dir`` (the state as the driver leaves it) in ``out``."""
    if not tune_dir.is_dir():
        return
    digest, count = _digest(tune_dir)
    atomic_write_bytes(out / SIGNATURE_FILE,
                       json.dumps({"hmac_sha256": digest, "files": count}).encode())


def verify(tune_dir: Path, out: Path) -> None:
    """Raise ``ValueError`` unless ``tune_dir`` is exactly what a search of this user left."""
    path = out / SIGNATURE_FILE
    how = ("resume only folders you made; for one of yours whose driver was killed before "
           "it could sign, pass --trust-tune-state")
    if not path.is_file():
        raise ValueError(f"{out}: the Ray Tune state is not signed ({SIGNATURE_FILE} is "
                         f"missing), so restoring it could run planted code; {how}")
    try:
        recorded = json.loads(path.read_text())["hmac_sha256"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path} is not a signature file; {how}") from None
    digest, _ = _digest(tune_dir)
    if not hmac.compare_digest(digest, str(recorded)):
        raise ValueError(f"{out}: the Ray Tune state does not match its signature (changed "
                         f"since this user's search wrote it, or signed with another key); "
                         f"{how}")
