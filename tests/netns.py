"""Hosts as Linux network namespaces: each with its own IP (10.231.X.n/24) and network
stack, all on one bridge inside a "switch" namespace, so a test can take one host's link
down and up, or shape it with tc, without touching the machine's own network. Nothing is
created outside the namespaces; `Net.close` deletes them all (and with them every link).

Runs that share a machine keep apart: the namespaces and links a `Net` makes are named with
its `prefix` (default `$TIERCEL_NETNS_PREFIX`, else "tcl"; at most 5 characters: a link's
name has at most 15) and a random tag; its hosts' addresses are 10.231.X.n with X its
`subnet` (default `$TIERCEL_NETNS_SUBNET`, else random)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import uuid


def default_prefix() -> str:
    """What namespace and link names start with when the caller names no prefix:
    $TIERCEL_NETNS_PREFIX (runs that share a machine keep apart), else "tcl"."""
    return os.environ.get("TIERCEL_NETNS_PREFIX", "tcl")[:5]


def unavailable(prefix: str | None = None) -> str | None:
    """Why namespace tests cannot run here (None when they can); the probe namespace's name
    starts with `prefix` (default: `default_prefix()`)."""
    prefix = prefix or default_prefix()
    if os.geteuid() != 0:
        return "network-namespace tests need root"
    if shutil.which("ip") is None:
        return "network-namespace tests need iproute2's `ip`"
    probe = f"{prefix}probe{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Net:
    """`n` hosts: namespace `ns(i)` with address `addr(i)` on its eth0. `prefix` starts every
    namespace and link name, `subnet` picks 10.231.<subnet>.0/24 (random by default): a caller
    that shares the machine keeps to the names and addresses it was given."""

    def __init__(self, n: int, prefix: str | None = None, subnet: int | None = None):
        self.prefix = prefix or default_prefix()
        self.tag = uuid.uuid4().hex[:5]
        if subnet is None and os.environ.get("TIERCEL_NETNS_SUBNET"):
            subnet = int(os.environ["TIERCEL_NETNS_SUBNET"])
        self.subnet = random.randint(1, 254) if subnet is None else subnet
        self.n = n
        self.names: list[str] = []
        try:
            self.switch = self._netns("sw")
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(n):
                host = self._netns(f"h{i}")
                sw_end, host_end = self.port(i), f"{self.prefix}{self.tag}e{i}"
                ip("link", "add", sw_end, "netns", self.switch, "type", "veth", "peer", "name", host_end, "netns", host)
                ip("-n", host, "link", "set", host_end, "name", "eth0")
                ip("-n", host, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                ip("-n", host, "link", "set", "eth0", "up")
                ip("-n", self.switch, "link", "set", sw_end, "master", "br0")
                ip("-n", self.switch, "link", "set", sw_end, "up")
        except BaseException:
            self.close()
            raise

    def _netns(self, suffix: str) -> str:
        name = f"{self.prefix}{self.tag}{suffix}"
        ip("netns", "add", name)
        self.names.append(name)
        ip("-n", name, "link", "set", "lo", "up")
        return name

    def ns(self, i: int) -> str:
        return f"{self.prefix}{self.tag}h{i}"

    def addr(self, i: int) -> str:
        return f"10.231.{self.subnet}.{i + 1}"

    def port(self, i: int) -> str:
        """Host i's port on the switch (its link: down there, and host i is cut off)."""
        return f"{self.prefix}{self.tag}v{i}"

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i)]

    def link(self, i: int, up: bool) -> None:
        ip("-n", self.switch, "link", "set", self.port(i), "up" if up else "down")

    def close(self) -> None:
        for name in reversed(self.names):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.names.clear()
