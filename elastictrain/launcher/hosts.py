"""Logical hosts of this machine: names that horovodrun runs locally but blacklists one by one.

horovodrun runs a host locally when its name resolves to an IPv4 address of one of this machine's
interfaces (Horovod's ``get_local_host_addresses``), and otherwise over ssh. ``localhost``,
``127.0.0.1``, the hostname and the primary address can therefore be up to four distinct hosts of one
machine, so that one dead worker does not take the whole machine out of the job. ``launch`` (embedded
mode), the demo, the benchmarks and the tests all pick hosts through :func:`local_logical_hosts`.
"""

from __future__ import annotations

import socket

import psutil


def local_addresses() -> set[str]:
    """IPv4 addresses of this machine's interfaces (what horovodrun compares with to run a host locally)."""
    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}


def resolve(name: str) -> str | None:
    """The IPv4 address ``name`` resolves to, or None."""
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def primary_address() -> str | None:
    """The first IPv4 address of an interface that is up and not loopback (no packet is sent)."""
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return None


def is_local(name: str) -> bool:
    """Whether horovodrun would run host ``name`` on this machine (it resolves to a local interface's address)."""
    return resolve(name) in local_addresses()


def local_logical_hosts() -> list[str]:
    """``localhost``, ``127.0.0.1``, the hostname and the primary address: those that resolve to this machine."""
    local = local_addresses()
    out: list[str] = []
    for name in ("localhost", "127.0.0.1", socket.gethostname(), primary_address()):
        if name and name not in out and resolve(name) in local:
            out.append(name)
    return out
