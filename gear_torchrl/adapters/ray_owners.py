"""Shard owners as Ray actors: Ray places, supervises and finds them; rows move over our transports only.

``start_owners`` places one ``ShardOwner`` actor per shard (in a placement
group spread over the nodes, or the user's) and waits until each serves. An
owner holds its shard in shared memory (``GearStorage(shared=True)``), where
writers on its node copy episodes in, and serves it over tcp
(``ShardServer``), where other nodes' learners and writers reach it. What a
process needs to reach an owner (its ``ShardDescriptor``, and the job's secret,
which every connection must prove it holds) comes from the owner's
``join_info`` actor call; rows never go through Ray's object store.

Ray supervises: with ``max_restarts`` a dead owner is started again (its
``__init__`` runs anew) and restores its shard from its last checkpoint under
``checkpoint_dir`` (taken every ``checkpoint_every`` seconds and on
``checkpoint()``), so what is lost is the rows committed since that
checkpoint; learners and writers find it again through ``locate``. An owner
that dies leaves no shared memory behind (its janitor, ``store/janitor.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gear_torchrl.adapters.rate_limiters import RateLimiter
from gear_torchrl.adapters.storage import GearStorage
from gear_torchrl.distributed.bootstrap import describe_served
from gear_torchrl.distributed.directory import ShardDescriptor
from gear_torchrl.distributed.shard_checkpoint import dump_shard, load_shard
from gear_torchrl.distributed.shard_server import ShardServer
from gear_torchrl.errors import PlacementError, ShardUnavailableError
from gear_torchrl.store.shared_commits import shared_part
from gear_torchrl.store.table_spec import NestedKey

logger = logging.getLogger(__name__)

RAY_MISSING = "ShardedGearStorage.on_ray needs Ray: pip install 'gear_torchrl[ray]' (it pins the Ray version we test)"
_START_S = 120.0  # how long owners may take to start (a Ray worker imports torch first), at the least
_LATEST = "LATEST"  # names the newest whole checkpoint of a shard; written last, atomically


def require_ray() -> Any:
    """The ``ray`` module, connected to a cluster (``ray.init()`` if this process is not yet); without Ray installed,
    an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(RAY_MISSING) from exc
    if not ray.is_initialized():
        ray.init()
    return ray


@dataclass(frozen=True)
class OwnerConfig:
    """What every owner of one store is made with (its shard number and the secret come apart)."""

    capacity: int
    end_keys: tuple[NestedKey, ...]
    traj_key: NestedKey | None
    timeout: float
    serve_on: str | None = None  # the address its server binds (default: its node's, as Ray knows it)
    rate_limiter: RateLimiter | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: float | None = None
    actor_options: dict[str, Any] = field(default_factory=dict)


class ShardOwner:
    """One shard's owner (a Ray actor: ``ray.remote`` makes it one in ``start_owners``)."""

    def __init__(self, shard: int, secret: bytes, config: OwnerConfig) -> None:
        import ray

        self.shard_id, self.config = shard, config
        self.storage = GearStorage(
            config.capacity,
            shared=True,
            end_keys=config.end_keys,
            traj_key=config.traj_key,
            rate_limiter=config.rate_limiter,
        )
        host = config.serve_on or ray.util.get_node_ip_address()
        shared_handle = shared_part(self.storage.shard).handle
        self.server = ShardServer(
            shared_handle, secret, host=host, timeout=config.timeout, admit=self.storage.admitting
        )
        self._secret = secret
        served = describe_served(shared_part(self.storage.shard), self.server, shard, None)
        self._descriptor = dataclasses.replace(served, shard=shard)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.restored = self._restore()
        if config.checkpoint_dir is not None and config.checkpoint_every is not None:
            threading.Thread(target=self._checkpoint_loop, name="gear-shard-checkpoints", daemon=True).start()

    # -- what a process needs to reach this shard -------------------------------------------
    def join_info(self) -> tuple[ShardDescriptor, bytes]:
        """This shard's descriptor and the job's secret (an actor call: Ray's own authenticated channel)."""
        return self._descriptor, self._secret

    def stats(self) -> dict[str, Any]:
        """The shard's ``stats()``, with where it runs (its process and Ray node) and what it restored."""
        node = require_ray().get_runtime_context().get_node_id()
        return {**self.storage.stats(), "pid": os.getpid(), "node_id": node, "restored": self.restored}

    # -- checkpoints --------------------------------------------------------------------------
    def _root(self) -> Path:
        assert self.config.checkpoint_dir is not None
        return Path(self.config.checkpoint_dir) / f"shard_{self.shard_id}"

    def checkpoint(self) -> dict[str, Any]:
        """Save the shard (rows, priorities, queues) as its newest checkpoint; older ones are removed."""
        if self.config.checkpoint_dir is None:
            raise ValueError("this store was made without checkpoint_dir: on_ray(..., checkpoint_dir=...)")
        with self._lock:
            root = self._root()
            root.mkdir(parents=True, exist_ok=True)
            name = f"ckpt-{time.time_ns()}"
            dump_shard(self.storage.shard, self.server.selectors, root / name)
            pointer = root / f"{_LATEST}.{os.getpid()}"
            pointer.write_text(name)
            os.replace(pointer, root / _LATEST)  # the checkpoint counts once whole
            for old in root.glob("ckpt-*"):
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)
            return {"path": str(root / name), "rows": len(self.storage)}

    def _restore(self) -> dict[str, Any] | None:
        """Load the newest checkpoint of this shard, if there is one (a restarted owner)."""
        if self.config.checkpoint_dir is None or not (self._root() / _LATEST).exists():
            return None
        path = self._root() / (self._root() / _LATEST).read_text().strip()
        load_shard(self.storage.shard, self.server.selectors, path)
        restored = {"path": str(path), "rows": len(self.storage)}
        logger.warning("shard %d restored %d rows from %s", self.shard_id, restored["rows"], path)
        return restored

    def _checkpoint_loop(self) -> None:
        every = self.config.checkpoint_every
        assert every is not None
        while not self._closed.wait(every):
            try:
                self.checkpoint()
            except Exception:  # the owner goes on serving; the next round tries again
                logger.exception("shard %d could not save its checkpoint", self.shard_id)

    def close(self) -> bool:
        """Stop serving and free the shard's memory."""
        self._closed.set()
        with self._lock:
            self.server.close()
            self.storage.close()
        return True


@dataclass
class RayOwners:
    """A store's owner actors in shard order, and the placement group made for them (removed with them)."""

    actors: list[Any]
    timeout: float
    placement_group: Any = None  # the one start_owners made, else None (the user's is theirs)
    home: bool = True  # this process started them: its close ends them (copies pickled elsewhere do not)

    def visitor(self) -> RayOwners:
        """What a copy of the store pickled into another process holds: the handles, not the right to end them."""
        return dataclasses.replace(self, placement_group=None, home=False)

    def join_info(self, timeout: float | None = None) -> tuple[list[ShardDescriptor], bytes]:
        """Every shard's descriptor and the job's secret, asked of the owners (Ray actor calls) within
        ``timeout`` (default: the store's)."""
        timeout = self.timeout if timeout is None else timeout
        answers = _answers([a.join_info.remote() for a in self.actors], timeout, "a shard owner did not answer")
        return [d for d, _ in answers], answers[0][1]

    def locate(self, shard: int) -> ShardDescriptor:
        """Where ``shard``'s owner serves now (a restarted owner serves elsewhere)."""
        ref = self.actors[shard].join_info.remote()
        return _answers([ref], self.timeout, f"shard {shard}'s owner is gone")[0][0]

    def checkpoint(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([a.checkpoint.remote() for a in self.actors], timeout=max(self.timeout, 60.0))

    def close(self) -> None:
        """Close every owner (its shard's memory freed), then end the actors and the placement group made."""
        import ray

        closing = [a.close.remote() for a in self.actors]
        for ref in closing:
            try:
                ray.get(ref, timeout=self.timeout)
            except Exception as exc:  # noqa: BLE001  (a dead owner's janitor frees its memory)
                logger.debug("a shard owner could not close itself: %s", exc)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
        self.actors = []


def start_owners(
    num_shards: int,
    secret: bytes,
    config: OwnerConfig,
    *,
    num_cpus: float,
    num_gpus: float,
    resources: dict[str, float] | None,
    placement_group: Any,
    max_restarts: int,
) -> RayOwners:
    """Place and start ``num_shards`` owners; each answers once it serves. Raises ``PlacementError`` naming the
    resources missing when the cluster cannot place them within ``config.timeout`` (nothing is left running)."""
    ray = require_ray()
    from ray.util.placement_group import placement_group as make_group
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": float(num_cpus), "GPU": float(num_gpus), **(resources or {})}
    bundle = {k: v for k, v in bundle.items() if v}
    made = None
    group = placement_group
    if group is None and bundle:  # Ray places bundles that ask for something; zero-resource actors are spread
        made = group = make_group([bundle] * num_shards, strategy="SPREAD")
        try:
            ray.get(group.ready(), timeout=config.timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise PlacementError(_unplaceable(num_shards, bundle, config.timeout, ray)) from None
    remote = ray.remote(ShardOwner)
    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "resources": resources or {},
        "max_restarts": max_restarts,
        "max_concurrency": 4,  # join_info and stats answer while a checkpoint is taken
        **config.actor_options,
    }
    actors = []
    try:
        for shard in range(num_shards):
            if group is not None:
                where = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=shard % group.bundle_count)
                actors.append(remote.options(scheduling_strategy=where, **options).remote(shard, secret, config))
            else:
                actors.append(remote.options(scheduling_strategy="SPREAD", **options).remote(shard, secret, config))
        owners = RayOwners(actors, config.timeout, made)
        owners.join_info(max(config.timeout, _START_S))  # each serves by now, or the store is not made
        return owners
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if made is not None:
            remove_placement_group(made)
        raise


def _answers(refs: list[Any], timeout: float, failure: str) -> list[Any]:
    """The owners' answers to actor calls ``refs``; an owner dead, restarting or silent past ``timeout`` is
    ``ShardUnavailableError`` (``failure`` says which)."""
    import ray

    try:
        return ray.get(refs, timeout=timeout)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as exc:
        raise ShardUnavailableError(f"{failure} within {timeout:g} s: {type(exc).__name__}: {exc}") from exc


def _unplaceable(num_shards: int, bundle: dict[str, float], timeout: float, ray: Any) -> str:
    total, free = ray.cluster_resources(), ray.available_resources()
    need = {k: v * num_shards for k, v in bundle.items()}
    missing = {k: v - free.get(k, 0.0) for k, v in need.items() if free.get(k, 0.0) < v}
    return (
        f"the cluster cannot place {num_shards} shard owners within {timeout:g} s: they need "
        f"{_amounts(need)} in all ({_amounts(bundle)} each); the cluster has {_amounts(total, need)}, "
        f"{_amounts(free, need)} free; missing {_amounts(missing)}. Ask for fewer shards or fewer resources "
        "per owner (on_ray(num_cpus=..., num_gpus=..., resources=...)), or add nodes"
    )


def _amounts(amounts: dict[str, float], keys: Sequence[str] | dict[str, float] | None = None) -> str:
    names = list(keys) if keys is not None else list(amounts)
    return ", ".join(f"{k} {amounts.get(k, 0.0):g}" for k in names) or "nothing"
