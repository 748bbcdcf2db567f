"""Whether a process still runs: how a shared store finds writers and readers that died.

A writer that dies holding a reservation, a reader that dies inside its read
section, a process that dies after its rate limiter admitted rows: each is
found by its pid, with these checks, and what it held is let go.
"""

from __future__ import annotations

import os


def pid_exists(pid: int) -> bool:
    """Whether ``pid`` exists, zombie or not (one system call: cheap enough for every commit)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead: it will never write again).

    When ``/proc`` cannot be read for another reason (no file descriptor left, say),
    a process that exists counts as alive: a transient OS error never declares a
    live writer dead, nor kills the caller.
    """
    if not pid_exists(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True
