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

from typing import Any, Self

from torchrl.data import TensorDictReplayBuffer

from gear_torchrl.adapters.sharded_storage import ShardedGearStorage


class GearRayReplayBuffer(TensorDictReplayBuffer):
    """``TensorDictReplayBuffer(storage=<on_ray storage>, sampler=..., batch_size=...)`` with TorchRL's service
    protocol: ``service_backend`` is ``"ray"``; ``client()`` and ``clients(n)`` give buffers over the same store
    for writers elsewhere; ``is_alive``, ``start()`` and ``shutdown()`` are ``ReplayBuffer``'s.

    ``shutdown()`` of the buffer (not of a client) ends the store: its owners stop and their memory is freed.
    """

    def __init__(self, *, storage: ShardedGearStorage, **kwargs: Any) -> None:
        if not isinstance(storage, ShardedGearStorage) or not storage.owners:
            raise TypeError(
                "GearRayReplayBuffer takes a sharded store on Ray: storage=ShardedGearStorage.on_ray(max_size, "
                f"num_shards=...), got {type(storage).__name__}"
            )
        super().__init__(storage=storage, **kwargs)
        self._owns_store = True

    @property
    def service_backend(self) -> str:
        """What TorchRL's RayCollector checks: this buffer is served on Ray."""
        return "ray"

    def client(self) -> Self:
        """A buffer over the same store for a writer elsewhere: pickled into a Ray task or actor it attaches
        there and writes into the shards; its ``shutdown`` leaves the store running."""
        if not self.is_alive:
            raise RuntimeError("this GearRayReplayBuffer was shut down: its store's owners are gone")
        storage = self._storage
        assert isinstance(storage, ShardedGearStorage)  # checked when made
        client = type(self)(storage=storage, batch_size=self._batch_size)
        client._owns_store = False
        return client

    def clients(self, num_clients: int) -> list[Self]:
        """One client per concurrent writer (each routes its own episodes)."""
        if isinstance(num_clients, bool) or not isinstance(num_clients, int):
            raise TypeError(f"num_clients must be an int, got {type(num_clients).__name__}")
        if num_clients < 1:
            raise ValueError(f"num_clients must be at least 1, got {num_clients}")
        return [self.client() for _ in range(num_clients)]

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish pending work; the buffer (not a client) then ends its store's owners. Safe to repeat."""
        super().shutdown(timeout)
        if self._owns_store:
            self._owns_store = False
            storage = self._storage
            assert isinstance(storage, ShardedGearStorage)  # checked when made
            storage.close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_owns_store"] = False  # a copy elsewhere is a client: the store is its maker's to end
        return state
