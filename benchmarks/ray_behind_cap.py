"""TorchRL's Ray buffer behind a capped link: its actor on a second Ray node, in a network namespace of its own.

On one host, Ray hands a sample from its actor to the learner through the
node's shared-memory object store, so no cap on loopback can slow it. Here the
learner's process starts the Ray head on one end of a veth pair; a second Ray
node runs in a network namespace behind the other end, and whatever it sends
back (replies, objects, the ``distributed`` transport's sockets) leaves through
one ``tc`` htb class of the cap, as one owner's port does in
``sharded_cost.py --cap-gbit``. Only that direction is capped: the steps the
learner writes reach the actor at full speed. The ``distributed`` transport's
gloo sockets are bound to the veth ends (``GLOO_SOCKET_IFNAME``), and its
rendezvous to the address the node's /etc/hosts gives this host's name (a
mount namespace of the node's own). Run inside the benchmark's own network
namespace (``unshare -n``): the names and addresses below are that
namespace's alone.

    with RayBehindCap(0.1) as placement:   # actors whose remote_config adds ``placement`` run behind the cap
        ...
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HEAD_IP, NODE_IP = "10.77.0.1", "10.77.0.2"
RESOURCE = "behind_cap"  # a custom resource only the capped node has: actors that ask for it land there
_START_S = 120


class RayBehindCap:
    """The Ray head here and a second node behind a link capped at ``gbit`` (its sending side)."""

    def __init__(self, gbit: float, num_cpus: int = 2) -> None:
        self.gbit, self.num_cpus = gbit, num_cpus
        self._holder: subprocess.Popen | None = None
        self._node: subprocess.Popen | None = None
        self._gloo_ifname: str | None = None
        self._hosts: str | None = None

    def __enter__(self) -> dict:
        """Start both nodes; the ``remote_config`` entries that place an actor behind the cap."""
        import ray

        # The node's network and mount namespaces, held by a sleeping process. Its /etc/hosts names this host
        # by the node's address, which the ``distributed`` transport's rendezvous binds and hands out.
        with tempfile.NamedTemporaryFile("w", prefix="gear_capped_hosts_", delete=False) as hosts:
            hosts.write(f"127.0.0.1 localhost\n{NODE_IP} {socket.gethostname()}\n")
        self._hosts = hosts.name
        self._holder = subprocess.Popen(
            ["unshare", "-n", "-m", "sh", "-c", f"mount --bind {self._hosts} /etc/hosts && exec sleep infinity"]
        )
        time.sleep(0.5)
        _run("ip", "link", "add", "gearA", "type", "veth", "peer", "name", "gearB", "netns", str(self._holder.pid))
        _run("ip", "addr", "add", f"{HEAD_IP}/24", "dev", "gearA")
        _run("ip", "link", "set", "gearA", "up")
        for cmd in (
            ("ip", "addr", "add", f"{NODE_IP}/24", "dev", "gearB"),
            ("ip", "link", "set", "gearB", "up"),
            ("ip", "link", "set", "lo", "up"),
            ("tc", "qdisc", "add", "dev", "gearB", "root", "handle", "1:", "htb", "default", "1"),
            (
                "tc",
                "class",
                "add",
                "dev",
                "gearB",
                "parent",
                "1:",
                "classid",
                "1:1",
                "htb",
                "rate",
                f"{self.gbit}gbit",
                "ceil",
                f"{self.gbit}gbit",
                "quantum",
                "200000",
            ),
        ):
            self._in_node(*cmd)
        self._gloo_ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        os.environ["GLOO_SOCKET_IFNAME"] = "gearA"  # the learner's end of the ``distributed`` transport
        context = ray.init(
            address="local",
            _node_ip_address=HEAD_IP,
            num_cpus=self.num_cpus,
            include_dashboard=False,
            log_to_driver=False,
        )
        self._node = subprocess.Popen(
            [
                "nsenter",
                "-t",
                str(self._holder.pid),
                "-n",
                "-m",
                sys.executable,
                "-m",
                "ray.scripts.scripts",
                "start",
                "--address",
                context.address_info["gcs_address"],
                "--node-ip-address",
                NODE_IP,
                "--num-cpus",
                "1",
                "--resources",
                json.dumps({RESOURCE: 1}),
                "--block",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "GLOO_SOCKET_IFNAME": "gearB"},
        )
        deadline = time.monotonic() + _START_S
        while not any(n["Alive"] and n["Resources"].get(RESOURCE) for n in ray.nodes()):
            if time.monotonic() > deadline or self._node.poll() is not None:
                self.__exit__()
                raise RuntimeError(f"the capped Ray node did not join within {_START_S} s")
            time.sleep(0.5)
        return {"resources": {RESOURCE: 0.01}}

    def __exit__(self, *_: object) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self._node is not None:  # ``ray stop`` ends the node's processes, and with them ``ray start --block``
            self._in_node(sys.executable, "-m", "ray.scripts.scripts", "stop", "--force", quiet=True)
            try:
                self._node.wait(30)
            except subprocess.TimeoutExpired:
                self._node.kill()
                self._node.wait(30)
        if self._holder is not None:
            self._holder.kill()
            self._holder.wait(30)
        subprocess.run(["ip", "link", "del", "gearA"], check=False, stderr=subprocess.DEVNULL)
        if self._hosts is not None:
            os.unlink(self._hosts)
        if self._gloo_ifname is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = self._gloo_ifname

    def _in_node(self, *cmd: str, quiet: bool = False) -> None:
        assert self._holder is not None
        _run("nsenter", "-t", str(self._holder.pid), "-n", "-m", *cmd, quiet=quiet)


def _run(*cmd: str, quiet: bool = False) -> None:
    silenced = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL} if quiet else {}
    subprocess.run(list(cmd), check=True, **silenced)
