"""A view of the rendezvous store whose records prove that a holder of the job's secret wrote them.

Whoever reaches the rendezvous store can read and write it. The RDMA handshake
runs through it (the owner's region, queue pair endpoints, learners'
announcements), so its records are sealed: each carries an HMAC of its key and
value under the job's secret. A record written by anyone else is refused:
no outsider gets a queue pair connected to an owner, or points a learner at
another queue pair or region. Records stay readable (they hold no secret);
sealing is about who wrote them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

_KIND = "gear-sealed/1"


class SealedStore:
    """``set``/``get``/``add`` of a ``torch.distributed.Store``, with sealed values."""

    def __init__(self, store: Any, secret: bytes) -> None:
        self._store = store
        self._secret = secret

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        record = {"kind": _KIND, "data": data.hex(), "tag": self._tag(key, data)}
        self._store.set(key, json.dumps(record).encode())

    def get(self, key: str) -> bytes:
        """The value under ``key`` (blocking as the store does); PermissionError unless the job sealed it."""
        try:
            record = json.loads(bytes(self._store.get(key)))
            data = bytes.fromhex(record["data"])
            sealed = record["kind"] == _KIND and hmac.compare_digest(record["tag"], self._tag(key, data))
        except (ValueError, TypeError, KeyError):
            sealed = False
        if not sealed:
            raise PermissionError(f"the record under {key!r} was not written by a process holding the job's secret")
        return data

    def add(self, key: str, amount: int) -> int:
        """A counter, unsealed: it only says how many records to look for, each of which is checked."""
        return self._store.add(key, amount)

    def _tag(self, key: str, data: bytes) -> str:
        return hmac.new(self._secret, key.encode() + b"\0" + data, hashlib.sha256).hexdigest()
