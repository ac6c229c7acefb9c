"""Machines for a test cluster, made of Linux namespaces: each node is a network, UTS and mount namespace with
its own hostname, its own address on a private bridge, and its own ``/etc/hosts`` naming every node.

The bridge lives in a namespace of its own (the "switch"); each node is joined to it by a veth pair. Nothing is
added to the host's network: the addresses exist only inside namespaces made here. Each namespace is held open
by a sleeping process started with ``unshare``; commands enter a node with ``nsenter``. A node is "lost" as in a
power loss by taking its link down, then SIGKILLing every process inside its network namespace except that
holder, so it can be started again.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

SUBNET = "10.77.0"
NEEDED = ("unshare", "nsenter", "ip", "mount")


class NoNamespaces(Exception):
    """Namespaces, veth pairs or bridges cannot be made here (the reason says which)."""


@dataclass
class Node:
    name: str
    addr: str
    holder: subprocess.Popen[bytes]
    port: str
    """Its veth's end on the bridge."""

    @property
    def pid(self) -> int:
        return self.holder.pid

    def enter(self) -> list[str]:
        """The prefix that runs a command on this node."""
        return ["nsenter", f"--target={self.pid}", "--net", "--uts", "--mount"]

    def processes(self) -> list[int]:
        """Every process on this node (in its network namespace), its holder excepted."""
        mine = os.readlink(f"/proc/{self.pid}/ns/net")
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.pid:
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == mine:
                    found.append(int(entry))
            except OSError:
                continue  # gone meanwhile, or not ours to read
        return found

    def kill(self) -> list[int]:
        """SIGKILL every process on the node, until none is left (PIDs returned)."""
        killed: list[int] = []
        deadline = time.monotonic() + 10
        while (left := self.processes()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        return sorted(set(killed))


class Network:
    """``count`` nodes named ``node1``..``nodeN`` at ``10.77.0.1``..``N`` and, with ``head``, a machine of that name
    at ``10.77.0.254`` (a cluster's head node: its controller, where commands are typed), on one bridge."""

    def __init__(self, root: pathlib.Path, count: int, head: str | None = None) -> None:
        self.root = root
        self.count = count
        self.head_name = head
        self.switch: subprocess.Popen[bytes] | None = None
        self.nodes: list[Node] = []
        self.head: Node | None = None

    def start(self) -> None:
        missing = [c for c in NEEDED if shutil.which(c) is None]
        if missing:
            raise NoNamespaces(f"{', '.join(missing)} not installed")
        hosts = self.root / "hosts"
        names = [(f"node{i}", f"{SUBNET}.{i}", f"v{i}") for i in range(1, self.count + 1)]
        if self.head_name:
            names.append((self.head_name, f"{SUBNET}.254", "vhead"))
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr, _ in names))
        self.switch = self._hold(["--net"])
        self._ip(self.switch.pid, "link", "add", "br0", "type", "bridge")
        self._ip(self.switch.pid, "link", "set", "br0", "up")
        for name, addr, port in names:
            node = Node(name, addr, self._hold(["--net", "--uts", "--mount", "--propagation", "private"]), port)
            if name == self.head_name:
                self.head = node
            else:
                self.nodes.append(node)
            self._ip(self.switch.pid, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                     "netns", str(node.pid))  # fmt: skip
            self._ip(self.switch.pid, "link", "set", port, "master", "br0", "up")
            for args in (("addr", "add", f"{addr}/24", "dev", "eth0"), ("link", "set", "eth0", "up"),
                         ("link", "set", "lo", "up")):  # fmt: skip
                self._ip(node.pid, *args)
            self._run([*node.enter(), "hostname", name])
            self._run([*node.enter(), "mount", "--bind", str(hosts), "/etc/hosts"])

    def isolate(self, name: str) -> None:
        """Node ``name``'s link down: its peers see silence (nothing it held open is closed towards them)."""
        self._ip(self.switch.pid, "link", "set", self.node(name).port, "down")

    def reconnect(self, name: str) -> None:
        """The link of node ``name`` up again (after ``isolate``)."""
        self._ip(self.switch.pid, "link", "set", self.node(name).port, "up")

    def node(self, name: str) -> Node:
        [found] = [n for n in [*self.nodes, *([self.head] if self.head else [])] if n.name == name]
        return found

    def stop(self) -> None:
        """Every process left on a node, then the holders."""
        machines = [*self.nodes, *([self.head] if self.head else [])]
        for node in machines:
            node.kill()
        for holder in [n.holder for n in machines] + ([self.switch] if self.switch else []):
            holder.kill()
            holder.wait(10)

    def _hold(self, kinds: Sequence[str]) -> subprocess.Popen[bytes]:
        holder = subprocess.Popen(["unshare", *kinds, "sleep", "infinity"], stderr=subprocess.PIPE)
        time.sleep(0.2)
        if holder.poll() is not None:
            raise NoNamespaces(f"unshare {' '.join(kinds)} failed: {holder.stderr.read().decode().strip()}")
        return holder

    def _ip(self, pid: int, *args: str) -> None:
        self._run(["nsenter", f"--target={pid}", "--net", "ip", *args])

    @staticmethod
    def _run(argv: Sequence[str]) -> None:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise NoNamespaces(f"{' '.join(argv)} failed: {done.stderr.strip()}")
