"""Named shared-memory segments of one store, and who removes them.

A store's segments are files in ``/dev/shm`` named ``gear_torchrl-<store id>.<part>``,
so every segment of a store is found from its id alone. The process that
creates a store starts a janitor (``gear_torchrl.store.janitor``) holding the
read end of a pipe; when the creator closes the store or dies, even by
SIGKILL, the pipe closes and the janitor marks the store dead and removes the
segments. Nothing else unlinks, so no segment outlives its owner and no
attached process can remove one under the others.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import select
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import torch

from gear_torchrl.kernels import _C

SHM_DIR = Path(os.environ.get("GEAR_TORCHRL_SHM_DIR", "/dev/shm"))
PREFIX = "gear_torchrl-"
PAGE = mmap.PAGESIZE
_RELEASE_WAIT_S = 30.0  # how long closing a store waits for its janitor to remove the segments


def new_store_id() -> str:
    return f"{os.getpid()}-{secrets.token_hex(6)}"


def segment_path(store_id: str, part: str) -> Path:
    return SHM_DIR / f"{PREFIX}{store_id}.{part}"


def store_segments(store_id: str) -> list[Path]:
    return sorted(SHM_DIR.glob(f"{PREFIX}{store_id}.*"))


def create_segment(path: Path, nbytes: int) -> None:
    """A new zero-filled segment; fails if one of that name exists."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def map_segment(path: Path) -> mmap.mmap:
    """The whole segment mapped shared, read-write."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"shared segment {path} does not exist: its store was closed or its owner died"
        ) from None
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def map_tensor(path: Path) -> torch.Tensor:
    """The whole segment as a shared uint8 tensor (zero copy; views of it stay valid while any exists)."""
    size = path.stat().st_size
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def page_round(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class SegmentLock:
    """Excludes every thread of every process attached to a segment.

    ``flock`` on the segment plus a thread lock (``flock`` is per open file, not per
    thread); the kernel drops a dead process's ``flock``, so no crash leaves it locked.
    """

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR)
        self._thread_lock = threading.Lock()

    def __enter__(self) -> None:
        self._thread_lock.acquire()
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread_lock.release()

    def close(self) -> None:
        os.close(self._fd)


class Janitor:
    """Removes a store's segments when this process closes the store or dies."""

    def __init__(self, store_id: str) -> None:
        launcher = subprocess.Popen(
            # The janitor script beside this file, on the standard library alone (-S): the same code as this
            # process runs, whatever an installer's import hooks would resolve the package to.
            [
                sys.executable,
                "-S",
                str(Path(__file__).with_name("janitor.py")),
                str(SHM_DIR),
                f"{PREFIX}{store_id}",
                *(str(v) for v in (_C.control.H_STATE, _C.control.CLOSED, _C.control.OWNER_DIED)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert launcher.stdin is not None and launcher.stdout is not None  # both are pipes
        self._stdin, self._stdout = launcher.stdin, launcher.stdout
        launcher.wait()  # it exits once it has forked the janitor, which holds the pipes on (see janitor.py)
        ready = self._stdout.readline()  # the janitor is watching before any segment exists
        if ready.strip() != b"ready":
            raise RuntimeError(f"the shared-memory janitor failed to start (said {ready!r})")
        self._inherited = False
        _JANITORS.add(self)

    def drop_inherited_pipe(self) -> None:
        """In a forked child (a DataLoader worker): close this copy of the pipe. Held open here, it would
        keep the janitor waiting after the owner closed the store or died, until the child ended."""
        self._inherited = True
        self._stdin.close()
        self._stdout.close()

    def release(self) -> None:
        """Remove the segments now (the owner closes the store)."""
        if self._inherited:  # the owner's janitor, not this process's
            return
        self._stdin.close()
        ready, _, _ = select.select([self._stdout], [], [], _RELEASE_WAIT_S)
        if ready:
            self._stdout.read()  # EOF once the janitor has removed the segments and exited
        self._stdout.close()


_JANITORS: weakref.WeakSet[Janitor] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for janitor in list(_JANITORS):
        janitor.drop_inherited_pipe()


os.register_at_fork(after_in_child=_after_fork_in_child)
