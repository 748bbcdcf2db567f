"""GearRayReplayBuffer: a replay buffer over a sharded store on Ray that speaks TorchRL's replay-service protocol.

TorchRL's ``RayCollector(..., replay_buffer=rb)`` takes a buffer whose
``service_backend`` is ``"ray"``: it asks ``rb.clients(n)`` for one client per
remote collector, pickles each into its collector, which calls ``extend`` (and
reads ``write_count``), while the learner samples ``rb``. Here a client is a
``TensorDictReplayBuffer`` over the same store: pickled into a collector it
attaches there and writes straight into the shards (shared memory on an owner's
node, tcp elsewhere), never through one actor, and rows never go through Ray's
object store. ``RayReplayBuffer``-style code (``rb.extend`` in actors,
``rb.sample`` in the learner) ports by changing the constructor line.
"""

from __future__ import annotations

from typing import Any

from torchrl.data import TensorDictReplayBuffer

from gear_torchrl.adapters.sharded_storage import ShardedGearStorage


class GearRayReplayBuffer(TensorDictReplayBuffer):
    """``TensorDictReplayBuffer(storage=<on_ray storage>, sampler=..., batch_size=...)`` with TorchRL's service
    protocol (``service_backend``, ``client()``, ``clients(n)``, ``is_alive``, ``start()``, ``shutdown()``).

    ``shutdown()`` (or ``close()``) from the process that made the store ends its owners and frees their memory.
    """

    def __init__(self, *, storage: ShardedGearStorage, **kwargs: Any) -> None:
        if not isinstance(storage, ShardedGearStorage) or not storage.owners:
            raise TypeError(
                "GearRayReplayBuffer takes a sharded store on Ray: storage=ShardedGearStorage.on_ray(max_size, "
                f"num_shards=...), got {type(storage).__name__}"
            )
        super().__init__(storage=storage, **kwargs)
        self._alive = True

    @property
    def service_backend(self) -> str:
        """What TorchRL's RayCollector checks: this buffer is served on Ray."""
        return "ray"

    @property
    def is_alive(self) -> bool:
        return self._alive

    def start(self) -> GearRayReplayBuffer:
        """The buffer, already serving (its owners started with the store)."""
        self._check_alive()
        return self

    def client(self) -> TensorDictReplayBuffer:
        """A buffer over the same store for a writer elsewhere: pickled into a Ray task or actor it attaches
        there and writes into the shards; it cannot end the owners."""
        self._check_alive()
        return TensorDictReplayBuffer(storage=self._storage, batch_size=self._batch_size)

    def clients(self, num_clients: int) -> list[TensorDictReplayBuffer]:
        """One client per concurrent writer (each routes its own episodes)."""
        if isinstance(num_clients, bool) or not isinstance(num_clients, int):
            raise TypeError(f"num_clients must be an int, got {type(num_clients).__name__}")
        if num_clients < 1:
            raise ValueError(f"num_clients must be at least 1, got {num_clients}")
        return [self.client() for _ in range(num_clients)]

    def shutdown(self, timeout: float | None = None) -> None:
        """End the store: its owners stop, their shared memory is freed (from the process that made it)."""
        if self._alive:
            self._alive = False
            self._storage.close()

    close = shutdown

    def _check_alive(self) -> None:
        if not self._alive:
            raise RuntimeError("this GearRayReplayBuffer was shut down: its store's owners are gone")
