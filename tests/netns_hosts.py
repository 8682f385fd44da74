"""Distinct hosts on one machine: Linux network namespaces joined to this one by veth pairs.

Each "host" is a network namespace of its own with one veth end inside it,
at a private address (10.x.y.z/30) that the root namespace routes to over the
pair's other end. A process started with ``ip netns exec NAME`` there sees only
that address and its own loopback, so a server bound to it is reached over TCP
at the address, as a server on another machine would be. The filesystem and
/dev/shm stay shared (only the network is private). Needs root and iproute2.

Names carry this process's id (``rmx<pid><letter>n<i>``), so parallel runs never
collide, and a later run deletes what a killed run left behind.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import random
import re
import shutil
import signal
import string
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

PREFIX = "rmx"
# Our namespaces: rmx, the creator's pid, a letter per set, n, the host index.
NAME = re.compile(rf"^{PREFIX}(\d+)[a-z]n\d+$")
# Where the subnets are drawn from: a /16 of 10/8 unlikely to be a site's own.
POOL = ipaddress.ip_network("10.213.0.0/16")
_sets = itertools.count()


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns is unavailable: {probe.stderr.strip()}"
    return None


def ip(*args: str) -> None:
    """``ip ARGS``; CalledProcessError (with ip's message) if it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, ["ip", *args], stderr=done.stderr)


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its address, and the address this side has on the link."""

    netns: str
    address: str
    gateway: str  # the root namespace's end of the veth pair
    veth: str  # the root namespace's end's name (the namespace's is ``veth``'s peer)

    def exec_prefix(self) -> list[str]:
        """Prepend to a command to run it in this host's namespace."""
        return ["ip", "netns", "exec", self.netns]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    out = subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True).stdout
    return [entry["name"] for entry in json.loads(out or "[]")]


def _delete_namespace(netns: str) -> None:
    """End what still runs in ``netns`` (a test's leftovers, all started there by
    us), then delete it; its veth ends go with it."""
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(subprocess.CalledProcessError):
        ip("netns", "del", netns)


def remove_stale() -> None:
    """Delete the namespaces of runs whose process is gone (killed before cleanup)."""
    for netns in _netns_names():
        match = NAME.match(netns)
        if match and not _pid_alive(int(match.group(1))):
            _delete_namespace(netns)


def _free_subnet(hosts: int) -> ipaddress.IPv4Network:
    """A random subnet of POOL, room for ``hosts`` /30s, overlapping no address or
    route this namespace has (another run's hosts included)."""
    size = 32 - max(2, (4 * hosts - 1).bit_length())
    taken = []
    for cmd in (["-4", "-j", "addr"], ["-4", "-j", "route"]):
        out = subprocess.run(["ip", *cmd], capture_output=True, text=True).stdout
        for entry in json.loads(out or "[]"):
            for info in entry.get("addr_info", []):
                taken.append(ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", False))
            if "dst" in entry and entry["dst"] != "default":
                taken.append(ipaddress.ip_network(entry["dst"], strict=False))
    candidates = list(POOL.subnets(new_prefix=size))
    random.shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError(f"no free /{size} left in {POOL}")


@contextlib.contextmanager
def private_hosts(count: int) -> Iterator[list[Host]]:
    """``count`` namespaces, each at an address of its own reachable from here;
    deleted on exit, whatever happened, with anything still running in them."""
    remove_stale()
    letter = string.ascii_lowercase[next(_sets) % 26]
    base = f"{PREFIX}{os.getpid()}{letter}"
    subnet = _free_subnet(count)
    links = list(subnet.subnets(new_prefix=30))
    hosts: list[Host] = []
    try:
        for i in range(count):
            gateway, address = (str(a) for a in itertools.islice(links[i].hosts(), 2))
            host = Host(f"{base}n{i}", address, gateway, f"{base}h{i}")
            ip("netns", "add", host.netns)
            hosts.append(host)
            peer = f"{base}p{i}"
            ip("link", "add", host.veth, "type", "veth", "peer", "name", peer, "netns", host.netns)
            ip("addr", "add", f"{gateway}/30", "dev", host.veth)
            ip("link", "set", host.veth, "up")
            ip("-n", host.netns, "addr", "add", f"{address}/30", "dev", peer)
            ip("-n", host.netns, "link", "set", peer, "up")
            # Loopback too: a server's own processes may talk over it.
            ip("-n", host.netns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for host in hosts:
            _delete_namespace(host.netns)
            # Normally gone with the namespace; a half-made one may have left it.
            with contextlib.suppress(subprocess.CalledProcessError):
                ip("link", "del", host.veth)
