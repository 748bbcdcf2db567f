"""Faults across hosts: learners that stall, outsiders at the rendezvous, owners out of descriptors or stopped.

Each test brings its own shard server or job on 127.0.0.1 and cleans up its
processes and shared memory, whatever happens.
"""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing as mp
import os
import signal
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import fault_workers as fw
import pytest
import torch
from helpers import descriptor_of, pid_of, segments_left_by_dead_owners, shm_segments

from gear_torchrl import GearStorage
from gear_torchrl.distributed import wire
from gear_torchrl.distributed.shard_client import ShardClient
from gear_torchrl.distributed.shard_server import ShardServer
from gear_torchrl.distributed.wire import Message, Op

pytestmark = pytest.mark.fault

CAPACITY = 1024
SPAWN = mp.get_context("spawn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join(10)


@contextmanager
def _served_full_shard(timeout: float):
    """A full shared shard served on 127.0.0.1; no memory left behind."""
    before = shm_segments()
    storage = GearStorage(CAPACITY, shared=True)
    server = None
    try:
        fw.fill(storage, CAPACITY)
        server = ShardServer(storage.handle, fw.SECRET, host="127.0.0.1", timeout=timeout)
        yield storage, server
    finally:
        if server is not None:
            server.close()
        storage.close()
        assert not segments_left_by_dead_owners(before)


def _authenticated(address, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # a small window: the owner's send blocks after a few KiB
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect(address)
    wire.answer_challenge(sock, fw.SECRET)
    return sock


def _requests_that_stall(kind: str) -> list[Message]:
    """What a learner sends before it stops reading (or never releases what it selected)."""
    uniform = {"kind": "uniform"}
    if kind == "select_read":
        return [Message(Op.SELECT, {"selection": uniform, "count": 16 * CAPACITY, "read": True})]
    if kind == "read":
        rows = torch.arange(16 * CAPACITY, dtype=torch.int64) % CAPACITY
        return [Message(Op.READ, {"window_len": 1}, [rows, torch.zeros_like(rows), torch.ones_like(rows)])]
    return [Message(Op.SELECT, {"selection": uniform, "count": 64, "read": False})]  # then no RELEASE


@pytest.mark.parametrize("kind", ["select_read", "read", "select_no_release"])
def test_a_learner_that_stops_reading_does_not_hold_back_the_owners_writers(kind):
    with _served_full_shard(timeout=1.0) as (storage, server):
        learner = _authenticated(server.address, rcvbuf=4096)
        for message in _requests_that_stall(kind):
            wire.send(learner, message)
        time.sleep(0.3)  # the owner is sending, or holds the selection
        commits, ready, stop = SPAWN.Value("q", 0), SPAWN.Event(), SPAWN.Event()
        writer = SPAWN.Process(target=fw.write_forever, args=(storage, commits, ready, stop))
        writer.start()
        try:
            assert ready.wait(60), "the writer never started"
            time.sleep(4.0)
            committed = commits.value
            stop.set()
            writer.join(10)
        finally:
            learner.close()
            _stop([writer])
        assert committed >= 20, f"the writer committed {committed} episodes in 4 s"


@pytest.mark.parametrize("pause_s", [0.0, 0.5])
def test_a_learner_that_reads_late_gets_exactly_its_rows(pause_s):
    """Sent from the ring while the socket takes them, copied out once it does not: the same bytes either way."""
    from gear_torchrl.kernels import gather

    with _served_full_shard(timeout=5.0) as (storage, server):
        generator = torch.Generator().manual_seed(int(pause_s * 10))
        starts = torch.randint(0, CAPACITY, (2048,), generator=generator)
        valid_begin = torch.randint(0, 3, (2048,), generator=generator)
        valid_end = valid_begin + torch.randint(0, 6, (2048,), generator=generator).clamp(max=8 - valid_begin)
        expected, _ = gather.gather_windows(
            storage.shard.visibility.mapped_columns(), starts, 8, torch.device("cpu"), valid_begin, valid_end
        )
        learner = _authenticated(server.address, rcvbuf=4096 if pause_s else None)
        wire.send(learner, Message(Op.READ, {"window_len": 8}, [starts, valid_begin, valid_end]))
        time.sleep(pause_s)  # long past the moment the owner stops waiting for room
        reply = wire.receive(learner)
        learner.close()
    assert reply.op == Op.OK, reply.meta
    assert [a.numel() for a in reply.arrays] == [e.numel() * e.element_size() for e in expected]
    for got, want in zip(reply.arrays, expected):
        assert torch.equal(got, wire.as_tensor_bytes(want.contiguous()))


def test_the_owner_drops_a_learner_that_stops_reading_and_serves_the_others():
    with _served_full_shard(timeout=1.0) as (storage, server):
        stalled = _authenticated(server.address, rcvbuf=4096)
        wire.send(stalled, _requests_that_stall("select_read")[0])
        deadline = time.monotonic() + 30  # a send times out once the kernel stops growing the send buffer
        while server._connections_now() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not server._connections_now(), "the owner still serves a learner that takes nothing"
        stalled.settimeout(5)
        with pytest.raises((ConnectionError, wire.ProtocolError)):  # what arrived is cut short, then closed
            while True:
                wire.receive(stalled)
        stalled.close()
        client = ShardClient(descriptor_of(server.address, storage.handle), fw.SECRET, 5.0)
        assert client.describe()["capacity"] == CAPACITY
        client.close()


class _FailingOnce:
    """A listener whose next ``accept`` fails with ``error`` once, as the kernel's would."""

    def __init__(self, listener: socket.socket, error: int) -> None:
        self._listener, self._error = listener, error

    def accept(self):
        if self._error:
            code, self._error = self._error, 0
            raise OSError(code, os.strerror(code))
        return self._listener.accept()

    def __getattr__(self, name):
        return getattr(self._listener, name)


@pytest.mark.parametrize("error", [errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED])
def test_an_accept_that_fails_once_does_not_stop_the_server(error):
    with _served_full_shard(timeout=5.0) as (storage, server):
        descriptor = descriptor_of(server.address, storage.handle)
        server._listener = _FailingOnce(server._listener, error)  # the loop picks it up on its next accept
        ShardClient(descriptor, fw.SECRET, 5.0).close()
        client = ShardClient(descriptor, fw.SECRET, 5.0)  # this accept fails once first
        assert client.describe()["capacity"] == CAPACITY
        client.close()


def test_an_owner_out_of_descriptors_greets_learners_again_once_some_are_free():
    before = shm_segments()
    pipe, theirs = SPAWN.Pipe()
    owner = SPAWN.Process(target=fw.serve_out_of_descriptors, args=(theirs,))
    owner.start()
    try:
        assert pipe.poll(60), "the owner never started"
        address, handle = pipe.recv()
        pipe.send("exhaust")
        assert pipe.poll(20) and pipe.recv() > 0
        waiting = socket.create_connection(address, timeout=10)  # queued by the kernel; accept fails (EMFILE)
        time.sleep(0.5)
        pipe.send("let go")
        assert pipe.poll(20) and pipe.recv() == "free"
        waiting.settimeout(10)
        assert waiting.recv(4) == wire.MAGIC  # greeted after all
        waiting.close()
        client = ShardClient(descriptor_of(address, handle), fw.SECRET, 10.0)
        assert client.describe()["capacity"] == 64
        client.close()
        pipe.send("stop")
        owner.join(30)
        assert owner.exitcode == 0
    finally:
        _stop([owner])
    assert not segments_left_by_dead_owners(before)


def test_unauthenticated_connections_are_bounded_and_timed_out():
    from gear_torchrl.distributed.shard_server import MAX_HANDSHAKES

    with _served_full_shard(timeout=1.0) as (storage, server):
        idle = [socket.create_connection(server.address, timeout=5) for _ in range(MAX_HANDSHAKES + 8)]
        try:
            greeted = 0
            for sock in idle:  # the surplus is closed at once, the rest after the handshake timeout (1 s)
                sock.settimeout(5)  # a timeout here fails the test: the server kept an idle connection
                received = b""
                try:
                    while chunk := sock.recv(1024):
                        received += chunk
                except ConnectionResetError:
                    pass
                greeted += received.startswith(wire.MAGIC)
            assert greeted <= MAX_HANDSHAKES
            client = ShardClient(descriptor_of(server.address, storage.handle), fw.SECRET, 5.0)
            assert client.describe()["capacity"] == CAPACITY
            client.close()
        finally:
            for sock in idle:
                sock.close()


# -- jobs under torch.distributed ---------------------------------------------------------------------
def _run_job(tmp: Path, world: int, options: dict, during=None) -> dict:
    """Run the ranks (and ``during(processes)`` meanwhile); every rank's result files, by name."""
    before = shm_segments()
    port = _free_port()
    processes = [
        SPAWN.Process(target=fw.run_rank, args=(r, world, port, str(tmp), options), name=f"rank{r}")
        for r in range(world)
    ]
    for p in processes:
        p.start()
    try:
        if during is not None:
            during(processes, port)
        (tmp / "finish").touch()
        for p in processes:
            p.join(120)
        assert [p.exitcode for p in processes] == [0] * world
    finally:
        for p in processes:
            if p.is_alive():
                os.kill(pid_of(p), signal.SIGCONT)
        _stop(processes)
    assert not segments_left_by_dead_owners(before)
    return {f.stem: json.loads(f.read_text()) for f in tmp.glob("*.json")}


def _candidate_keys(value: bytes) -> list[bytes]:
    """Every form in which a stored value could be a key: as stored, stripped, and hex- or text-decoded."""
    candidates = {value, value.strip()}
    with contextlib.suppress(ValueError):
        candidates.add(bytes.fromhex(value.decode().strip()))
    return [c for c in candidates if c]


def test_nothing_in_the_rendezvous_store_authenticates_and_servers_do_not_listen_everywhere(tmp_path):
    def outsider(processes, port):
        fw.wait_for(tmp_path / "server_0.json")
        reader = SPAWN.Process(target=fw.read_the_store, args=(port, str(tmp_path)))
        reader.start()
        reader.join(60)
        assert reader.exitcode == 0
        fw.wait_for(tmp_path / "learner_1.json")
        server = json.loads((tmp_path / "server_0.json").read_text())
        address = (server["host"], server["port"])
        stored = json.loads((tmp_path / "store.json").read_text())
        assert stored, "the outsider found no keys at all"
        for value in stored.values():
            for candidate in _candidate_keys(bytes.fromhex(value) if not value.startswith("unreadable") else b""):
                with socket.create_connection(address, timeout=10) as sock, pytest.raises(PermissionError):
                    wire.answer_challenge(sock, candidate)

    results = _run_job(tmp_path, 2, {"owners": [0]}, outsider)
    assert results["learner_1"]["before"] == "served"
    assert results["server_0"]["host"] not in ("0.0.0.0", "::", "")


def test_an_operator_secret_is_used_and_never_stored(tmp_path):
    secret = "operator secret: 32 random bytes"

    def outsider(processes, port):
        fw.wait_for(tmp_path / "learner_1.json")
        reader = SPAWN.Process(target=fw.read_the_store, args=(port, str(tmp_path)))
        reader.start()
        reader.join(60)
        assert reader.exitcode == 0
        server = json.loads((tmp_path / "server_0.json").read_text())
        with socket.create_connection((server["host"], server["port"]), timeout=10) as sock:
            wire.answer_challenge(sock, secret.encode())  # the operator's secret is the job's

    env = {"GEAR_TORCHRL_SECRET": secret}
    results = _run_job(tmp_path, 2, {"owners": [0], "env": {"0": env, "1": env}}, outsider)
    assert results["learner_1"]["before"] == "served"
    for value in results["store"].values():
        assert secret.encode().hex() not in value and secret.encode() not in bytes.fromhex(value)


def test_ranks_with_different_secrets_refuse_to_start(tmp_path):
    env = {
        "0": {"GEAR_TORCHRL_SECRET": "one secret of at least 16 bytes"},
        "1": {"GEAR_TORCHRL_SECRET": "another secret of 16 bytes or more"},
    }
    results = _run_job(tmp_path, 2, {"owners": [0], "env": env})
    for rank in (0, 1):
        refused = results[f"refused_{rank}"]
        assert refused["type"] == "PermissionError" and "rank 1" in refused["message"], refused


@pytest.fixture(scope="module")
def stopped_owner_job(tmp_path_factory):
    """Owner rank 2 is stopped for longer than the learners' timeout, then continued.

    Learner 0 raises on a failed shard, learner 1 skips it; both try every path
    while the owner is stopped and again once it runs.
    """
    tmp = tmp_path_factory.mktemp("stopped")
    (tmp / "stop").touch()
    learners = {
        "0": {"on_shard_failure": "raise", "transport": "tcp"},
        "1": {"on_shard_failure": "skip", "transport": "tcp"},
    }

    def stop_and_continue(processes, port):
        for r in (0, 1):
            fw.wait_for(tmp / f"sampled_{r}")
        os.kill(processes[2].pid, signal.SIGSTOP)
        try:
            (tmp / "stopped").touch()
            for r in (0, 1):
                fw.wait_for(tmp / f"tried_{r}", 120)
        finally:
            os.kill(processes[2].pid, signal.SIGCONT)
        (tmp / "continued").touch()
        for r in (0, 1):
            fw.wait_for(tmp / f"learner_{r}.json", 120)

    return _run_job(tmp, 3, {"owners": [2], "timeout": 1.0, "learners": learners}, stop_and_continue)


def test_raise_mode_serves_a_stopped_shard_again_once_it_answers(stopped_owner_job):
    outcome = stopped_owner_job["learner_0"]
    for path, result in outcome["stopped"].items():
        assert result["type"] in (None, "ShardUnavailableError"), (path, result)
        assert result["seconds"] < 5, (path, result)
    assert outcome["stopped"]["sample"]["type"] == "ShardUnavailableError"
    assert "timed out" in outcome["stopped"]["sample"]["message"]
    for path, result in outcome["continued"].items():
        assert result["type"] is None, (path, result)


def test_skip_mode_names_the_failed_shards_and_why_when_none_is_left(stopped_owner_job):
    outcome = stopped_owner_job["learner_1"]
    for path, result in {**outcome["stopped"], **outcome["continued"]}.items():
        assert result["type"] == "ShardUnavailableError", (path, result)
        assert "shard 0" in result["message"] and "timed out" in result["message"], (path, result)
