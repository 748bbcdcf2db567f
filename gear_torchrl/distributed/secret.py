"""The job's secret: what a process must prove it holds before a shard owner serves it.

It never travels through or rests in the rendezvous store, which anyone who
reaches its port can read. Either the operator gives every rank the same
secret (``GEAR_TORCHRL_SECRET``, or a file named by ``GEAR_TORCHRL_SECRET_FILE``),
or rank 0 draws one and broadcasts it over the process group's own
connections. Then every rank checks it holds rank 0's secret, without sending it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

import torch.distributed as dist

SECRET_ENV = "GEAR_TORCHRL_SECRET"
SECRET_FILE_ENV = "GEAR_TORCHRL_SECRET_FILE"
MIN_SECRET_BYTES = 16
_AGREE = b"gear_torchrl: ranks agree on the secret"  # keeps the check apart from a shard server's challenge


def operator_secret() -> bytes | None:
    """The secret the operator set for this process (environment or file), or None."""
    text, path = os.environ.get(SECRET_ENV), os.environ.get(SECRET_FILE_ENV)
    if text and path:
        raise ValueError(f"set {SECRET_ENV} or {SECRET_FILE_ENV}, not both")
    if path:
        secret = Path(path).read_bytes().strip()
    elif text:
        secret = text.encode()
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the job's secret must be at least {MIN_SECRET_BYTES} bytes long (e.g. the output of "
            f"`openssl rand -hex 32`), got {len(secret)}"
        )
    return secret


def job_secret(group: dist.ProcessGroup | None = None) -> bytes:
    """This rank's copy of the job's secret, the same on every rank of ``group`` (a collective).

    A rank whose secret is missing, unreadable or different still takes part in
    both collectives, so that every rank raises instead of the others hanging.
    """
    try:
        mine, problem = operator_secret(), None
    except (OSError, ValueError) as exc:
        mine, problem = None, exc
    first = dist.get_rank(group) == 0
    drawn = secrets.token_bytes(32) if first and mine is None else None
    nonce = secrets.token_bytes(16)
    held = mine if mine is not None else drawn  # rank 0 holds one either way
    message = [(drawn, nonce, _proof(held, nonce) if first and held is not None else None)]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(message, src=src, group=group)  # the ranks' own connections, not the store
    drawn, nonce, proof = message[0]
    assert proof is not None  # rank 0's, which it always sends
    secret = mine if mine is not None else drawn
    holds = problem is None and secret is not None and hmac.compare_digest(_proof(secret, nonce), proof)
    verdicts: list[bool | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, holds, group=group)
    if problem is not None:
        raise problem
    differ = [f"rank {rank}" for rank, ok in enumerate(verdicts) if not ok]
    if differ:
        raise PermissionError(
            f"not every rank holds rank 0's secret (not: {', '.join(differ)}): set the same "
            f"{SECRET_ENV} (or {SECRET_FILE_ENV}) on every rank, or on none"
        )
    assert secret is not None  # this rank holds rank 0's secret: it is not among those that differ
    return secret


def _proof(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, _AGREE + nonce, hashlib.sha256).digest()
