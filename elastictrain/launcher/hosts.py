"""Logical hosts of this machine: names that horovodrun runs locally but blacklists one by one.

horovodrun runs a host locally when its name resolves to an IPv4 address of one of this machine's
interfaces (Horovod's ``get_local_host_addresses``), and otherwise over ssh. ``localhost``,
``127.0.0.1``, the hostname and the primary address can therefore be up to four distinct hosts of one
machine, so that one dead worker does not take the whole machine out of the job.

Beyond those four, the loopback network gives as many as a job needs: Linux routes all of
``127.0.0.0/8`` to ``lo``, so ``127.0.0.2``, ``127.0.0.3``, ... are addresses of this machine that no
interface lists. Stock horovodrun would ssh to them; the repaired horovodrun of ``launch``
(:mod:`elastictrain.horovod.hvdrun`) runs every loopback address locally (:func:`is_local` says the same).

``launch`` (embedded mode), the demo, the benchmarks and the tests all pick hosts through
:func:`local_logical_hosts`.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import socket

import psutil

LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")


def local_addresses() -> set[str]:
    """IPv4 addresses of this machine's interfaces (what stock horovodrun compares with to run a host locally)."""
    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}


def is_loopback(address: str | None) -> bool:
    """Whether ``address`` is an IPv4 address in ``127.0.0.0/8``."""
    if not address:
        return False
    try:
        return ipaddress.IPv4Address(address) in LOOPBACK
    except ValueError:
        return False


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
    """Whether launch's horovodrun runs host ``name`` on this machine: it resolves to a local interface's address
    or to a loopback address."""
    address = resolve(name)
    return address is not None and (address in local_addresses() or is_loopback(address))


@functools.cache
def loopback_aliases_work() -> bool:
    """Whether this machine's kernel answers on loopback addresses besides 127.0.0.1 (binds 127.0.0.2, port 0)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.2", 0))
        return True
    return False


def local_logical_hosts(count: int | None = None) -> list[str]:
    """Logical hosts of this machine, at most ``count`` (None: the named ones only).

    First ``localhost``, ``127.0.0.1``, the hostname and the primary address, the ones that resolve to this
    machine; then, while ``count`` asks for more, the loopback addresses ``127.0.0.2``, ``127.0.0.3``, ... (only
    where the kernel answers on them: :func:`loopback_aliases_work`).
    """
    local = local_addresses()
    out: list[str] = []
    for name in ("localhost", "127.0.0.1", socket.gethostname(), primary_address()):
        if name and name not in out and resolve(name) in local:
            out.append(name)
    if count is None:
        return out
    if len(out) < count and loopback_aliases_work():
        taken = {resolve(h) for h in out}
        for address in LOOPBACK.hosts():
            if len(out) >= count:
                break
            if str(address) not in taken:
                out.append(str(address))
    return out[:count]
