"""Which address a rank's peer server tells the other ranks to connect to.

A server listening on every interface ("0.0.0.0") must advertise one the other hosts can
reach. Like gloo and torch.distributed, tiercel takes the interface the kernel would use to
reach the job's coordinator ($MASTER_ADDR): the host name's address is often 127.0.0.1 (many
container images map the host name to loopback in /etc/hosts), and a loopback address sent
to another host reaches that host itself. The peer handshake refuses such a connection
either way; this picks an address that works.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from .errors import ConfigError


def _is_wildcard(ip: str) -> bool:
    return ip in ("", "0.0.0.0", "::", "[::]")


def _route_to(host: str, port: int) -> str | None:
    """The local address of the interface that reaches `host` (no packet is sent: a UDP
    socket's connect only picks the route)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return None
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(addr)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


def advertised_address(listen: str) -> str:
    """The "ip:port" to advertise for a server bound to `listen` ("ip:port" as bound).

    Order: an explicit listen address as is; $TIERCEL_ADVERTISE; the interface that reaches
    $MASTER_ADDR; the address the host name resolves to."""
    ip, port = listen.rsplit(":", 1)
    if not _is_wildcard(ip):
        return listen
    chosen = os.environ.get("TIERCEL_ADVERTISE")
    if not chosen and os.environ.get("MASTER_ADDR"):
        chosen = _route_to(os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500") or 29500))
    if not chosen:
        name = socket.gethostname()
        try:
            chosen = socket.gethostbyname(name)
        except socket.gaierror as e:
            raise ConfigError(
                f"cannot find this host's address for the peer tier: host name {name!r} does not resolve ({e}); "
                "set TIERCEL_ADVERTISE to an address the other hosts can reach (and TIERCEL_HOST to name this host), "
                "or give the peer tier's `listen` an explicit address"
            ) from e
    if ":" in chosen and not chosen.startswith("["):
        chosen = f"[{chosen}]"
    return f"{chosen}:{port}"


def is_loopback(addr: str) -> bool:
    """Whether an advertised "ip:port" is a loopback address."""
    ip = addr.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return ip == "localhost"
