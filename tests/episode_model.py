"""Brute-force model of the episode index: split the surviving steps at their ends."""

from __future__ import annotations


def model_episodes(steps: list[tuple[int, bool, int | None]], capacity: int):
    """``steps``: (global step number, done, traj id) for every appended step, in order.

    Returns (start_row, length, closed) per live episode, oldest first.
    """
    live = steps[-capacity:]
    steps[:-capacity] if len(steps) > capacity else []
    episodes = []
    current = None
    for i, (g, done, traj) in enumerate(live):
        if current is None:
            current = [g % capacity, 0, False]
        current[1] += 1
        nxt = live[i + 1] if i + 1 < len(live) else None
        ends = done or (traj is not None and nxt is not None and nxt[2] != traj)
        if ends:
            current[2] = True
            episodes.append(tuple(current))
            current = None
    if current is not None:
        episodes.append(tuple(current))
    return episodes
