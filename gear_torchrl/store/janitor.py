"""Janitor of one store's shared memory: ``python -S janitor.py DIR PREFIX STATE CLOSED DIED``.

It waits for its stdin to close (the owner closed the store, or died), then
marks the store dead in its control segment, so attached processes fail
with a clear error instead of waiting, and removes every segment named
``PREFIX.*``. It runs as the owner's grandchild: the process the owner starts
forks it and exits at once, so a supervisor that kills the direct children
of a worker it stops (Ray does, on ``ray.kill`` of an actor) leaves it to do
its work. The owner knows it has finished when its stdout closes.

Kept free of torch so it starts in milliseconds: the control segment's
state word and its 'closed' and 'owner died' values come on the command
line (``Janitor`` passes them from ``_C.control``, where they are defined).
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import sys
from pathlib import Path


def _mark(control: Path, state_word: int, closed: int, state: int) -> None:
    try:
        fd = os.open(control, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        with mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED) as m:
            current = struct.unpack_from("<q", m, state_word * 8)[0]
            if current != closed:
                struct.pack_into("<q", m, state_word * 8, state)
    finally:
        os.close(fd)


def main(directory: str, prefix: str, state_word: int, closed: int, owner_died: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the owner's group must not orphan the segments
    if os.fork():  # the owner's child exits here; the janitor is its child, no longer the owner's
        os._exit(0)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.buffer.read()  # returns when the owner's end closes, however it ended
    root = Path(directory)
    _mark(root / f"{prefix}.control", state_word, closed, owner_died)
    for path in root.glob(f"{prefix}.*"):
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]))
