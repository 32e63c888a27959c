"""Multi-node tier: each node a network namespace on a link-local bridge, running sshd and an agent.

``python -m chaos run node-killed`` / ``node-partitioned`` run the scenario job on a :class:`Cluster`:

1. a bridge ``etn<token>`` in this (root) namespace with ``169.254.<o>.1/24`` (link-local, ``o`` = 77 unless
   another live tier holds it): nothing here is routed off the machine, and no namespace has a default route;
2. per node ``i``: ``ip netns add etn<token>-n<i>``; a veth pair whose bridge end is ``etn<token>v<i>`` and
   whose other end, moved into the namespace, is renamed ``etn<token>``, the bridge's own name (interface
   names are per namespace), with ``169.254.<o>.<10+i>/24``. Horovod's driver looks up
   ``--network-interfaces etn<token>`` in its namespace (the bridge) and every worker looks up the same
   name in its own (``HOROVOD_GLOO_IFACE``), so both find their address on the bridge's subnet;
3. per node a real ``sshd -D`` inside the namespace, listening on the node's address only, host key and
   authorized key generated in the tier's temp dir, and a real ``elastictrain agent --host <address>``
   against a real etcd listening on the bridge address (free ports, data dir in the temp dir);
4. an ``ssh`` wrapper first on the launcher's PATH (``ssh -F <tier ssh_config>``: the tier's key, no known
   hosts file, batch mode, keep-alives that end a session to an unreachable node within about 6 s, and a
   ``ProxyCommand /bin/false`` for any host outside the tier's subnet), so
   ``elastictrain launch --etcd ... -- --network-interfaces etn<token>`` makes horovodrun start every worker
   over ssh exactly as on a cluster (same filesystem, so the same venv and run dir);
5. faults are real: a node killed = SIGKILL of every pid of ``ip netns pids`` (sshd, sessions, agent,
   workers), and the node may boot again (sshd and agent started anew); a node partitioned = its bridge
   veth down for a while (:func:`chaos.faults.partition_host`);
6. teardown in ``finally`` (``Cluster.__exit__``): agents stopped, every pid of each namespace SIGKILLed,
   etcd stopped, veths, namespaces and the bridge deleted, the temp dir removed; then it checks that none
   of it is left (:attr:`Cluster.leftovers`).

Each tier records itself (owner pid, names) in ``/run/elastictrain-netns/<token>.json`` before it creates
anything, so a later tier removes what a killed one left (only names such a record lists).

Requirements: root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), ``ip`` (iproute2), ``sshd``, ``ssh`` and
``ssh-keygen`` (openssh-server / openssh-client; ``scripts/setup.sh`` installs them), ``etcd``.
:func:`preflight` says in one line why the tier is skipped where any of it is missing.

Size: one tier's whole life (create, run, tear down, find leftovers): every name it creates is removed here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from chaos import faults
from chaos.jobs import LAUNCH_FLAGS, LaunchedJob
from chaos.procs import REPO, JobRef
from elastictrain import envnames
from elastictrain.commands import agent_command
from elastictrain.errors import ScenarioError
from elastictrain.fileio import write_atomic
from elastictrain.launcher.etcd import EtcdServer
from elastictrain.launcher.processes import free_port
from elastictrain.rundir.events import Reset, of_kind

SUBNET = "169.254.77.0/24"
"""Link-local: never routed beyond this machine. The tier's default subnet."""
PREFERRED_OCTET = 77
OCTETS = range(64, 128)
"""Third octets a tier may use (``169.254.64.0``-``169.254.127.255``, well away from ``169.254.169.254``)."""
NAME_PREFIX = "etn"
NODE_HOST_BASE = 10
"""Node ``i`` is ``169.254.<o>.<10+i>``; the bridge is ``.1``."""
MAX_NODES = 99
IFNAMSIZ = 15
"""Longest Linux interface name."""
SSH_PORT = 22
"""Each node's sshd listens on port 22 of the node's own address, in its own namespace (free by construction)."""
STATE_DIR = Path("/run/elastictrain-netns")
NETNS_ETC = Path("/etc/netns")
"""``ip netns exec NS`` bind-mounts ``/etc/netns/NS/*`` over ``/etc/*`` (iproute2's convention)."""
NODE_READY_SECONDS = 60.0
PRIVATE_ROOT = Path("/var/tmp")
"""Where a share-nothing tier keeps its files: not ``/tmp``, which every node replaces with a disk of its own."""
STORE_BUCKET = "elastictrain-tier"
"""The bucket a share-nothing tier's object store holds (a fresh store per tier)."""
STORE_CHAIN = {
    "AWS_ACCESS_KEY_ID": "tier",
    "AWS_SECRET_ACCESS_KEY": "tier-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
"""The AWS chain's variables for the tier's own S3 server (dummy keys; never an instance role)."""


class TierUnavailable(ScenarioError):
    """The multi-node tier cannot run here, or a step of it failed (one line)."""


# ---------------------------------------------------------------------------------------------- names (pure)
@dataclass(frozen=True, slots=True)
class TierNames:
    """Every name and address of one tier, derived from a random token (so runs cannot collide)."""

    token: str
    octet: int = PREFERRED_OCTET
    nodes: int = 3

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[0-9a-f]{5}", self.token):
            raise ValueError(f"token must be 5 lowercase hex digits, got {self.token!r}")
        if self.octet not in OCTETS:
            raise ValueError(f"octet must be in {OCTETS.start}..{OCTETS.stop - 1}, got {self.octet}")
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes must be in 1..{MAX_NODES}, got {self.nodes}")

    @classmethod
    def new(cls, nodes: int, octet: int = PREFERRED_OCTET) -> TierNames:
        return cls(os.urandom(3).hex()[:5], octet, nodes)

    @property
    def iface(self) -> str:
        """The bridge (root namespace) and every node's interface (inside its namespace): one name."""
        return f"{NAME_PREFIX}{self.token}"

    def netns(self, i: int) -> str:
        """Node ``i``'s network namespace; also its hostname (in its own UTS namespace)."""
        return f"{self.iface}-n{self._node(i)}"

    def veth(self, i: int) -> str:
        """Node ``i``'s veth end on the bridge (root namespace): the one a partition takes down."""
        return f"{self.iface}v{self._node(i)}"

    def peer(self, i: int) -> str:
        """Temporary name of the other end, before it moves into the namespace and becomes :attr:`iface`."""
        return f"{self.iface}p{self._node(i)}"

    @property
    def subnet(self) -> str:
        return f"169.254.{self.octet}.0/24"

    @property
    def bridge_address(self) -> str:
        return f"169.254.{self.octet}.1"

    def address(self, i: int) -> str:
        return f"169.254.{self.octet}.{NODE_HOST_BASE + self._node(i)}"

    def node_of(self, host: str) -> int | None:
        """The node index whose address is ``host``, else None."""
        prefix = f"169.254.{self.octet}."
        if not host.startswith(prefix) or not host[len(prefix) :].isdigit():
            return None
        i = int(host[len(prefix) :]) - NODE_HOST_BASE
        return i if 0 <= i < self.nodes else None

    def namespaces(self) -> list[str]:
        return [self.netns(i) for i in range(self.nodes)]

    def links(self) -> list[str]:
        """Links of the root namespace, veths first (deleting one deletes its peer)."""
        return [*(self.veth(i) for i in range(self.nodes)), self.iface]

    def to_json(self) -> dict[str, Any]:
        return {"token": self.token, "octet": self.octet, "nodes": self.nodes}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TierNames:
        return cls(str(data["token"]), int(data["octet"]), int(data["nodes"]))

    def _node(self, i: int) -> int:
        if not 0 <= i < self.nodes:
            raise ValueError(f"node {i} out of range 0..{self.nodes - 1}")
        return i


def choose_octet(used: set[int]) -> int:
    """The third octet for a new tier: 77 unless a live tier (or anything) uses it, else the first free one."""
    for octet in (PREFERRED_OCTET, *OCTETS):
        if octet not in used:
            return octet
    raise TierUnavailable(f"multi-node chaos tier: every subnet 169.254.{OCTETS.start}-{OCTETS.stop - 1}.0/24 is used")


# ---------------------------------------------------------------------------------------------- configs (pure)
def sshd_config(*, address: str, port: int, host_key: Path, authorized_keys: Path) -> str:
    """A node's sshd: its own address only, key login for root, keep-alives (a vanished client's session ends)."""
    return "\n".join(
        [
            "# elastictrain multi-node chaos tier: one node's sshd (inside the node's network namespace)",
            f"ListenAddress {address}",
            f"Port {port}",
            f"HostKey {host_key}",
            f"AuthorizedKeysFile {authorized_keys}",
            "PidFile none",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "UseDNS no",
            "PrintMotd no",
            "X11Forwarding no",
            "AllowTcpForwarding no",
            "MaxStartups 64",
            "MaxSessions 64",
            "ClientAliveInterval 2",
            "ClientAliveCountMax 3",
            "LogLevel ERROR",
            "",
        ]
    )


def etc_hosts(names: TierNames, i: int) -> str:
    """Node ``i``'s ``/etc/hosts`` (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over it): its hostname
    resolves to its own address, as on a cluster. Horovod 0.28.1 needs that: the Gloo context of a process set
    ignores ``HOROVOD_GLOO_IFACE`` and binds to what the hostname resolves to (``127.0.0.1`` for this machine's
    shared hostname, which is every namespace's own loopback)."""
    return "\n".join(
        [
            "# elastictrain multi-node chaos tier: one node's view",
            "127.0.0.1 localhost",
            f"{names.address(i)} {names.netns(i)}",
            "::1 localhost ip6-localhost ip6-loopback",
            "",
        ]
    )


def boot_command(names: TierNames, i: int, argv: list[str], mounts: Sequence[str] = ()) -> list[str]:
    """``argv`` on node ``i``: in its network namespace, in a UTS namespace of its own named after the node, and with
    ``mounts`` (:func:`node_mounts`) in a mount namespace of its own."""
    script = " && ".join(['hostname "$0"', *mounts, 'exec "$@"'])
    private = ["--mount", "--propagation", "private"] if mounts else []
    return [
        "ip", "netns", "exec", names.netns(i),  # execs: the pid stays the one of argv in the end
        "unshare", "--uts", *private,
        "sh", "-c", script, names.netns(i), *argv,
    ]  # fmt: skip


def node_mounts(*, disk: Path, code: Path, run_dir: Path, home: Path, hidden: Path, stage: Path) -> list[str]:
    """Shell commands giving a node a disk of its own (``disk``'s ``tmp``, ``cache`` and ``run``): its own ``/tmp``,
    ``~/.cache`` and run_dir (at the launcher's run_dir path), the code and its venv read-only as in an image, and
    ``hidden`` (the tier's disks) covered, so no node sees another's disk. The code goes through ``stage`` (outside
    ``/tmp``), so a checkout under ``/tmp`` is still there once ``/tmp`` is the node's own."""
    q = lambda path: shlex.quote(str(path))  # noqa: E731
    cache = home / ".cache"
    return [
        f"mkdir -p {q(stage)}",
        f"mount --bind {q(code)} {q(stage)}",
        f"mount --bind {q(disk / 'tmp')} /tmp",
        f"mkdir -p {q(cache)}",
        f"mount --bind {q(disk / 'cache')} {q(cache)}",
        f"mkdir -p {q(code)}",
        f"mount --bind {q(stage)} {q(code)}",
        f"mount -o remount,bind,ro {q(code)}",
        f"mkdir -p {q(run_dir)}",
        f"mount --bind {q(disk / 'run')} {q(run_dir)}",
        f"mount -t tmpfs -o size=1m,mode=0700 tmpfs {q(hidden)}",
    ]


def ssh_config(*, names: TierNames, identity: Path, port: int = SSH_PORT) -> str:
    """The client side (``ssh -F``): only the tier's subnet; never ``~/.ssh``; a dead link ends in ~6 s."""
    subnet_glob = f"169.254.{names.octet}.*"
    return "\n".join(
        [
            f"# elastictrain multi-node chaos tier {names.token}: ssh reaches the tier's nodes and nothing else",
            f"Host {subnet_glob}",
            "  User root",
            f"  Port {port}",
            f"  IdentityFile {identity}",
            "  IdentitiesOnly yes",
            "  UserKnownHostsFile /dev/null",
            "  GlobalKnownHostsFile /dev/null",
            "  StrictHostKeyChecking no",
            "  BatchMode yes",
            "  LogLevel ERROR",
            "  ConnectTimeout 5",
            "  ServerAliveInterval 2",
            "  ServerAliveCountMax 3",
            f"Host * !{subnet_glob}",
            "  ProxyCommand /bin/false",
            "",
        ]
    )


def ssh_wrapper(real_ssh: str, config: Path) -> str:
    """``ssh`` for the front of PATH: the real client with the tier's config (horovodrun runs ``ssh`` from PATH)."""
    return f'#!/bin/sh\nexec {shlex.quote(real_ssh)} -F {shlex.quote(str(config))} "$@"\n'


def launch_flags(*, etcd: str, job: str, iface: str) -> tuple[str, ...]:
    """``elastictrain launch`` flags of a job on the tier: the tier's etcd (no embedded one), the tier's NIC."""
    return ("--etcd", etcd, "--job", job, "--", "--network-interfaces", iface)


def clean_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the variables that tie a process to a job or a Horovod run."""
    return {k: v for k, v in env.items() if not k.startswith((envnames.PREFIX, "HOROVOD_"))}


# ---------------------------------------------------------------------------------------------- system
def aws_notice(when: float) -> dict[str, str]:
    """AWS's ``spot/instance-action`` answer for an instance terminated at Unix time ``when``."""
    return {"action": "terminate", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))}


def sshd_binary() -> str | None:
    for candidate in (shutil.which("sshd"), "/usr/sbin/sshd"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise TierUnavailable(f"multi-node chaos tier: `ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def preflight() -> str | None:
    """None when the tier can run here; otherwise one line saying why it is skipped."""
    if shutil.which("ip") is None:
        return "multi-node chaos tier skipped: `ip` (iproute2) is not installed"
    if sshd_binary() is None:
        return "multi-node chaos tier skipped: sshd is not installed (apt-get install openssh-server)"
    for tool, package in (
        ("ssh", "openssh-client"),
        ("ssh-keygen", "openssh-client"),
        ("unshare", "util-linux"),
        ("hostname", "hostname"),
    ):
        if shutil.which(tool) is None:
            return f"multi-node chaos tier skipped: `{tool}` is not installed (apt-get install {package})"
    if shutil.which("etcd") is None and not os.access("/usr/bin/etcd", os.X_OK):
        return "multi-node chaos tier skipped: etcd is not installed (apt-get install etcd-server)"
    if os.geteuid() != 0:
        return "multi-node chaos tier skipped: network namespaces need root"
    probe = f"etprobe-{os.urandom(4).hex()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"multi-node chaos tier skipped: network namespaces are not permitted here ({made.stderr.strip()})"
    try:
        for what, args in (
            ("veth pairs", ["link", "add", "p0", "type", "veth", "peer", "name", "p1"]),
            ("bridges", ["link", "add", "b0", "type", "bridge"]),
        ):
            done = _ip("-n", probe, *args, check=False)
            if done.returncode != 0:
                return f"multi-node chaos tier skipped: {what} are not permitted here ({done.stderr.strip()})"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def namespace_pids(ns: str) -> list[int]:
    done = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in done.stdout.split() if x.isdigit()] if done.returncode == 0 else []


def existing_namespaces() -> set[str]:
    done = _ip("netns", "list", check=False)
    return {line.split()[0] for line in done.stdout.splitlines() if line.strip()}


def existing_links() -> set[str]:
    return set(psutil.net_if_stats())


def used_octets() -> set[int]:
    """Third octets of ``169.254.x.y`` addresses on this namespace's interfaces (live tiers among them)."""
    out = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            parts = str(a.address).split(".")
            if a.family == socket.AF_INET and parts[:2] == ["169", "254"] and parts[2].isdigit():
                out.add(int(parts[2]))
    return out


def kill_namespace(ns: str, timeout: float = 15.0) -> list[int]:
    """SIGKILL every process in ``ns`` (by pid, as ``ip netns pids`` lists them) until none is left."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while pids := namespace_pids(ns):
        procs = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                p.kill()
                procs.append(p)
                killed.append(pid)
        psutil.wait_procs(procs, timeout=2)
        if time.monotonic() > deadline:
            break
    return killed


def destroy(names: TierNames) -> None:
    """Remove what a tier with ``names`` created: its processes, veths, namespaces and bridge (each if present)."""
    namespaces = existing_namespaces()
    for ns in names.namespaces():
        if ns in namespaces:
            kill_namespace(ns)
    links = existing_links()
    for link in names.links():  # veths first: deleting one deletes its end inside the namespace too
        if link in links:
            _ip("link", "del", link, check=False)
    for ns in names.namespaces():
        if ns in namespaces:
            _ip("netns", "del", ns, check=False)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()  # only when no other namespace keeps files there


def what_is_left(names: TierNames, procs: list[psutil.Process], paths: list[Path]) -> list[str]:
    """Namespaces, links, processes (of ``procs``: pid and start time, so a reused pid is not one) and paths of
    the tier that still exist."""
    left = [f"namespace {ns}" for ns in sorted(existing_namespaces() & set(names.namespaces()))]
    for ns in names.namespaces():
        left += [f"process {pid} in {ns}" for pid in namespace_pids(ns)]
    left += [f"link {link}" for link in sorted(existing_links() & set(names.links()))]
    left += [f"path {NETNS_ETC / ns}" for ns in names.namespaces() if (NETNS_ETC / ns).exists()]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"process {p.pid} {' '.join(p.cmdline())[:80]}")
    left += [f"path {p}" for p in paths if p.exists()]
    return left


@contextlib.contextmanager
def _state_lock() -> Iterator[None]:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with (STATE_DIR / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _recorded(state: Mapping[str, Any], what: str) -> psutil.Process | None:
    """The live process recorded as ``<what>_pid`` / ``<what>_started`` (pid and start time: never a reused pid)."""
    try:
        p = psutil.Process(int(state[f"{what}_pid"]))
        same = abs(p.create_time() - float(state[f"{what}_started"])) < 1.0
        return p if same and p.status() != psutil.STATUS_ZOMBIE else None
    except (psutil.Error, KeyError, ValueError, TypeError):
        return None


def clean_stale() -> list[str]:
    """Remove tiers whose owner process is gone (only what their state files name); their tokens."""
    cleaned = []
    with contextlib.suppress(FileNotFoundError):
        for path in sorted(STATE_DIR.glob("*.json")):
            try:
                state = json.loads(path.read_text())
                names = TierNames.from_json(state)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if _recorded(state, "owner") is not None:
                continue
            for what in ("etcd", "store"):  # the processes of a tier outside its namespaces
                proc = _recorded(state, what)
                if proc is not None:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
                        proc.wait(10)
            destroy(names)
            tmp = state.get("tmp")
            if tmp and Path(tmp).name.startswith("elastictrain-netns-"):
                shutil.rmtree(tmp, ignore_errors=True)
            path.unlink(missing_ok=True)
            cleaned.append(names.token)
    return cleaned


def _boto_keys() -> dict[str, str]:
    return {
        "aws_access_key_id": STORE_CHAIN["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": STORE_CHAIN["AWS_SECRET_ACCESS_KEY"],
    }


def _stop(proc: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    """SIGTERM ``proc``, SIGKILL it after ``timeout`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _wait(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TierUnavailable(f"multi-node chaos tier: timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def sshd_answers(address: str, port: int = SSH_PORT, timeout: float = 1.0) -> bool:
    """An SSH server greets on ``address:port`` (its ``SSH-2.0`` banner)."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(8).startswith(b"SSH-")
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------- the cluster
class Cluster:
    """``nodes`` namespaces on a bridge, each with sshd and an agent of ``job``, and an etcd; a context manager.

    ``__exit__`` tears everything down and stores what could not be removed in :attr:`leftovers` (empty when
    the machine is as it was).
    """

    def __init__(
        self,
        *,
        nodes: int,
        job: str,
        log_dir: Path,
        ttl_seconds: float = 3.0,
        heartbeat_seconds: float = 0.5,
        prefix: str = "/elastictrain",
        drain_grace_seconds: float = 2.0,
        out: Callable[[str], None] = print,
        share_nothing_run_dir: Path | None = None,
        preemption_notice: bool = False,
    ) -> None:
        from elastictrain.config import DiscoveryConfig

        self.nodes = nodes
        self.job = job
        self.log_dir = log_dir
        self.discovery = DiscoveryConfig(prefix=prefix, ttl_seconds=ttl_seconds, heartbeat_seconds=heartbeat_seconds)
        self.drain_grace_seconds = drain_grace_seconds
        self.out = out
        self.names: TierNames | None = None
        self.tmp: Path | None = None
        self.state_file: Path | None = None
        self.etcd: Any = None
        self.sshd: dict[int, subprocess.Popen[bytes]] = {}
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        self.procs: list[psutil.Process] = []
        """Every process the tier started (etcd, each sshd and agent), for the final check."""
        self.leftovers: list[str] = []
        self.run_dir = share_nothing_run_dir.resolve() if share_nothing_run_dir is not None else None
        """Set: the tier shares nothing but the network. Each node has a disk of its own (its /tmp, caches and a
        run_dir at this path; :func:`node_mounts`), the code read-only, and the tier runs an S3 server on the bridge
        (:attr:`store`) for the checkpoints; the launcher's run_dir (this path, here) is the only one that lasts."""
        self.store: subprocess.Popen[bytes] | None = None
        self.store_endpoint = ""
        self.provisioned: list[Path] = []
        self.preemption_notice = preemption_notice
        """Set: each node has a metadata service of its own on the bridge speaking AWS's protocol (the local one of
        ``tests/fixtures/metadata_server.py``), and its agent watches it (``--preemption-notice aws``):
        :meth:`give_notice` is the cloud's spot notice to that node."""
        self.metadata: dict[int, Any] = {}

    # -- life
    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.leftovers = self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.leftovers = self.teardown()

    @property
    def n(self) -> TierNames:
        assert self.names is not None, "the cluster is not started"
        return self.names

    @property
    def etcd_endpoint(self) -> str:
        return str(self.etcd.endpoint)

    def start(self) -> None:
        reason = preflight()
        if reason is not None:
            raise TierUnavailable(reason)
        for token in clean_stale():
            self.out(f"multi-node tier: removed a stale tier etn{token} (its owner is gone)")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(
            tempfile.mkdtemp(prefix="elastictrain-netns-", dir=PRIVATE_ROOT if self.share_nothing else None)
        )
        with _state_lock():
            self.names = TierNames.new(self.nodes, choose_octet(used_octets()))
            self.state_file = STATE_DIR / f"{self.names.token}.json"
            self._write_state()
            n = self.names
            _ip("link", "add", n.iface, "type", "bridge")
            _ip("addr", "add", f"{n.bridge_address}/24", "dev", n.iface)
            _ip("link", "set", n.iface, "up")
        for i in range(self.nodes):
            self._make_node(i)
        self._keys()
        self._start_etcd()
        if self.share_nothing:
            for i in range(self.nodes):
                self.wipe_disk(i)
            self._start_store()
        if self.preemption_notice:
            for i in range(self.nodes):
                self._start_metadata(i)
        for i in range(self.nodes):
            self.start_node(i)
        for i in range(self.nodes):
            self.wait_node_ready(i)
        self.out(
            f"multi-node tier etn{n.token}: {self.nodes} namespaces on bridge {n.iface} ({n.subnet}), "
            f"sshd + agent each, etcd at {self.etcd_endpoint}"
        )

    def _write_state(self) -> None:
        """What a later tier needs to remove this one if this process dies: names, owner, etcd, temp dir."""
        assert self.state_file is not None and self.names is not None
        me = psutil.Process()
        state: dict[str, Any] = {**self.names.to_json(), "owner_pid": me.pid, "owner_started": me.create_time()}
        if self.etcd is not None:
            etcd = psutil.Process(self.etcd.pid)
            state.update(etcd_pid=etcd.pid, etcd_started=etcd.create_time())
        if self.store is not None:
            store = psutil.Process(self.store.pid)
            state.update(store_pid=store.pid, store_started=store.create_time())
        state["tmp"] = str(self.tmp)
        write_atomic(self.state_file, json.dumps(state) + "\n")

    def _make_node(self, i: int) -> None:
        n = self.n
        ns = n.netns(i)
        _ip("netns", "add", ns)
        _ip("link", "add", n.veth(i), "type", "veth", "peer", "name", n.peer(i))
        _ip("link", "set", n.peer(i), "netns", ns)
        _ip("link", "set", n.veth(i), "master", n.iface)
        _ip("link", "set", n.veth(i), "up")
        _ip("-n", ns, "link", "set", n.peer(i), "name", n.iface)
        _ip("-n", ns, "addr", "add", f"{n.address(i)}/24", "dev", n.iface)
        _ip("-n", ns, "link", "set", n.iface, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
        (NETNS_ETC / ns / "hosts").write_text(etc_hosts(n, i))

    def _keys(self) -> None:
        assert self.tmp is not None
        ssh_dir = self.tmp / "ssh"
        ssh_dir.mkdir(mode=0o700)
        for key in ("host_key", "id_ed25519"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"elastictrain-netns-{self.n.token}",
                 "-f", str(ssh_dir / key)],
                check=True, capture_output=True, timeout=30,
            )  # fmt: skip
        shutil.copy(ssh_dir / "id_ed25519.pub", ssh_dir / "authorized_keys")
        (ssh_dir / "ssh_config").write_text(ssh_config(names=self.n, identity=ssh_dir / "id_ed25519"))
        for i in range(self.nodes):
            (ssh_dir / f"sshd_config-n{i}").write_text(
                sshd_config(
                    address=self.n.address(i),
                    port=SSH_PORT,
                    host_key=ssh_dir / "host_key",
                    authorized_keys=ssh_dir / "authorized_keys",
                )
            )
        real_ssh = shutil.which("ssh")
        assert real_ssh is not None
        bin_dir = self.tmp / "bin"
        bin_dir.mkdir()
        (bin_dir / "ssh").write_text(ssh_wrapper(real_ssh, ssh_dir / "ssh_config"))
        (bin_dir / "ssh").chmod(0o755)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir (Debian's path)

    @property
    def share_nothing(self) -> bool:
        return self.run_dir is not None

    def disk(self, i: int) -> Path:
        """Node ``i``'s own disk (a folder of this machine that only node ``i`` mounts)."""
        assert self.tmp is not None
        return self.tmp / "disks" / f"n{i}"

    def wipe_disk(self, i: int) -> None:
        """Node ``i``'s disk, empty (a new machine's): its ``tmp``, ``cache`` and ``run``, and the provisioned files."""
        disk = self.disk(i)
        shutil.rmtree(disk, ignore_errors=True)
        for sub in ("tmp", "cache", "run"):
            (disk / sub).mkdir(parents=True)
        (disk / "tmp").chmod(0o1777)
        for path in self.provisioned:
            self._provision_one(i, path)

    def provision(self, path: Path) -> None:
        """Put ``path`` (a file under the launcher's run_dir: the job's config) on every node's disk, as an image or a
        config map would, now and whenever a node boots with an empty disk."""
        assert self.run_dir is not None
        self.provisioned.append(path.resolve())
        for i in range(self.nodes):
            self._provision_one(i, path.resolve())

    def _provision_one(self, i: int, path: Path) -> None:
        assert self.run_dir is not None
        target = self.disk(i) / "run" / path.relative_to(self.run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)

    def _mounts(self, i: int) -> list[str]:
        if self.run_dir is None:
            return []
        assert self.tmp is not None
        return node_mounts(
            disk=self.disk(i),
            code=REPO,
            run_dir=self.run_dir,
            home=Path.home(),
            hidden=self.tmp / "disks",
            stage=self.tmp / "code",
        )

    def _start_store(self) -> None:
        """An S3 server (moto's, as the tests' own) on the bridge, with an empty :data:`STORE_BUCKET`."""
        import boto3

        port = free_port(self.n.bridge_address)
        self.store_endpoint = f"http://{self.n.bridge_address}:{port}"
        moto = shutil.which("moto_server", path=os.path.dirname(os.path.realpath(sys.executable)))
        if moto is None:
            raise TierUnavailable("share-nothing tier: moto_server is not installed (make setup installs it)")
        with (self.log_dir / "store.log").open("ab") as log:
            self.store = subprocess.Popen(
                [moto, "-H", self.n.bridge_address, "-p", str(port)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self._track(self.store.pid)
        self._write_state()
        client = boto3.client("s3", endpoint_url=self.store_endpoint, region_name="us-east-1", **_boto_keys())

        def created() -> bool:
            if self.store is not None and self.store.poll() is not None:
                raise TierUnavailable(f"share-nothing tier: the S3 server exited; see {self.log_dir}/store.log")
            try:
                client.create_bucket(Bucket=STORE_BUCKET)
            except Exception:
                return False
            return True

        _wait(created, 30, "the tier's S3 server")

    def store_env(self) -> dict[str, str]:
        """The AWS chain's variables that reach the tier's S3 server (empty without one)."""
        if not self.store_endpoint:
            return {}
        return {"AWS_ENDPOINT_URL_S3": self.store_endpoint, **STORE_CHAIN}

    def _start_etcd(self) -> None:
        assert self.tmp is not None
        self.etcd = EtcdServer(self.tmp / "etcd", self.log_dir / "etcd.log", host=self.n.bridge_address)
        self.etcd.start()
        self._track(self.etcd.pid)
        self._write_state()

    # -- what a job on the tier needs
    def launch_flags(self) -> tuple[str, ...]:
        return launch_flags(etcd=self.etcd_endpoint, job=self.job, iface=self.n.iface)

    def launcher_env(self) -> dict[str, str]:
        """For ``elastictrain launch``: the ssh wrapper first on PATH; one thread per worker (they share the cores)."""
        assert self.tmp is not None
        return {"PATH": f"{self.tmp / 'bin'}:{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1", **self.store_env()}

    def hosts(self) -> list[str]:
        return [self.n.address(i) for i in range(self.nodes)]

    # -- nodes
    def _spawn(self, i: int, argv: list[str], log_name: str, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        with (self.log_dir / log_name).open("ab") as log:
            proc = subprocess.Popen(
                boot_command(self.n, i, argv, self._mounts(i)),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
            )
        self._track(proc.pid)
        return proc

    def _track(self, pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            self.procs.append(psutil.Process(pid))

    def start_node(self, i: int) -> None:
        """Boot node ``i``: its sshd and its agent (again, after a kill)."""
        assert self.tmp is not None
        sshd = sshd_binary()
        assert sshd is not None
        base = clean_env(os.environ)
        config = self.tmp / "ssh" / f"sshd_config-n{i}"
        self.sshd[i] = self._spawn(i, [sshd, "-D", "-e", "-f", str(config)], f"sshd-n{i}.log", base)
        agent = agent_command(
            self.discovery,
            etcd=self.etcd_endpoint,
            job=self.job,
            host=self.n.address(i),
            drain_grace_seconds=self.drain_grace_seconds,
        )
        env = {**base, envnames.JOB: self.job}
        if self.preemption_notice:  # a new machine: no notice on its metadata service
            self.metadata[i].set(aws_action=None)
            agent = [*agent, "--preemption-notice", "aws"]
            env[envnames.AWS_METADATA] = self.metadata[i].url
        # The agent carries the job in its environment, like the launcher's agents: chaos.procs finds it.
        self.agents[i] = self._spawn(i, agent, f"agent-n{i}.log", env)

    def ready_hosts(self) -> set[str]:
        from discovery.registry import EtcdRegistry, RegistryError

        reg = EtcdRegistry(self.etcd_endpoint, self.job, self.discovery.prefix, timeout_seconds=2.0)
        try:
            return {e.record.host for e in reg.list_hosts().entries if e.record.state == "ready"}
        except RegistryError:
            return set()
        finally:
            with contextlib.suppress(Exception):
                reg.close()

    def wait_node_ready(self, i: int, timeout: float = NODE_READY_SECONDS) -> None:
        """Until node ``i``'s sshd greets from its address and its agent's key is ``ready`` in etcd."""
        address = self.n.address(i)

        def ready() -> bool:
            for proc, what in ((self.sshd[i], "sshd"), (self.agents[i], "agent")):
                if proc.poll() is not None:
                    raise TierUnavailable(
                        f"multi-node chaos tier: the {what} of node {i} exited ({proc.returncode}); "
                        f"see {self.log_dir}/{what}-n{i}.log"
                    )
            return sshd_answers(address) and address in self.ready_hosts()

        _wait(ready, timeout, f"node {i} ({address}): sshd and a ready agent")

    # -- faults
    def kill_node(self, i: int, log: faults.ChaosLog, job: JobRef) -> dict[str, Any]:
        """The machine dies: SIGKILL every process in node ``i``'s namespace (sshd, sessions, agent, workers)."""
        host, ns = self.n.address(i), self.n.netns(i)
        workers = [w.describe() for w in job.workers() if w.host == host]
        pids = namespace_pids(ns)
        record = log.log("kill-host", job=job.job, host=host, netns=ns, pids=pids, workers=workers)
        killed = kill_namespace(ns)
        for proc in (self.sshd[i], self.agents[i]):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if namespace_pids(ns):
            raise TierUnavailable(f"multi-node chaos tier: processes still in {ns} after SIGKILL")
        return {**record, "killed": killed}

    def partition(self, i: int, log: faults.ChaosLog, job: JobRef, seconds: float) -> dict[str, Any]:
        """Node ``i`` cut off the bridge (its veth down) for ``seconds``, then back."""
        return faults.partition_host(log, job, self.n.address(i), seconds=seconds, veth=self.n.veth(i))

    def _start_metadata(self, i: int) -> None:
        from tests.fixtures.metadata_server import MetadataServer

        self.metadata[i] = MetadataServer(host=self.n.bridge_address).__enter__()

    def _stop_metadata(self) -> None:
        for server in self.metadata.values():
            server.__exit__(None, None, None)

    def give_notice(self, i: int, log: faults.ChaosLog, job: JobRef, seconds: float) -> dict[str, Any]:
        """The cloud's spot notice to node ``i`` (AWS ``spot/instance-action``: terminate in ``seconds``); its agent
        reads it within a poll and drains the host."""
        if not self.preemption_notice:
            raise ScenarioError("a preemption notice needs the tier's metadata services (Cluster(preemption_notice=))")
        now = time.time()
        self.metadata[i].set(aws_action=aws_notice(now + seconds))
        return log.log(
            "preemption-notice", job=job.job, host=self.n.address(i), node=i, notice_time=round(now + seconds, 3)
        )

    def replace_node(self, i: int, log: faults.ChaosLog, job: JobRef) -> dict[str, Any]:
        """The cloud ends node ``i`` and a new machine takes its place: every process SIGKILLed, the disk emptied,
        the node booted again (no notice on its metadata service) and ready."""
        record = self.kill_node(i, log, job)
        if self.share_nothing:
            self.wipe_disk(i)
            log.log("disk-lost", job=job.job, host=self.n.address(i), node=i)
        self.start_node(i)
        self.wait_node_ready(i)
        log.log("host-returns", job=job.job, host=self.n.address(i), node=i)
        return record

    def store_outage(self, log: faults.ChaosLog, job: JobRef, seconds: float) -> dict[str, Any]:
        """The tier's S3 server SIGSTOPped for ``seconds`` (connections hang, as in an outage); SIGCONT after."""
        if self.store is None:
            raise ScenarioError("a store outage needs the share-nothing tier's S3 server")
        store = psutil.Process(self.store.pid)
        record = log.log("store-down", job=job.job, seconds=seconds, store_pid=store.pid)
        try:
            store.send_signal(signal.SIGSTOP)
            faults._hold(seconds)
        finally:
            with contextlib.suppress(psutil.Error):
                store.send_signal(signal.SIGCONT)
            log.log("store-down", phase="end", job=job.job, store_pid=store.pid)
        return record

    # -- the end
    def stop_agents(self, timeout: float = 10.0) -> None:
        """SIGTERM twice (drain, then skip the grace: the lease is revoked) to every live agent; SIGKILL late ones."""
        live = [p for p in self.agents.values() if p.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGTERM)
        for proc in live:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def teardown(self) -> list[str]:
        """Remove everything of the tier (each step even when an earlier one failed); what is still there."""
        errors: list[str] = []
        steps: list[tuple[str, Callable[[], object]]] = [("stop agents", self.stop_agents)]
        if self.etcd is not None:
            steps.append(("stop etcd", self.etcd.stop))
        if self.store is not None:
            steps.append(("stop the S3 server", lambda: _stop(self.store)))
        if self.metadata:
            steps.append(("stop the metadata services", self._stop_metadata))
        if self.names is not None:
            steps.append(("remove namespaces and links", lambda: destroy(self.n)))
        for what, step in steps:
            try:
                step()
            except Exception as e:  # keep going: the rest must still be removed
                errors.append(f"{what}: {e}")
        for proc in (*self.sshd.values(), *self.agents.values()):
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        paths = [p for p in (self.tmp, self.state_file) if p is not None]
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self.state_file is not None:
            self.state_file.unlink(missing_ok=True)
        if self.names is None:
            return errors + [f"path {p}" for p in paths if p.exists()]
        left: list[str] = []
        deadline = time.monotonic() + 10  # the kernel frees a deleted namespace's links asynchronously
        while time.monotonic() < deadline:
            left = what_is_left(self.n, self.procs, paths)
            if not left:
                break
            time.sleep(0.2)
        return errors + left


# ---------------------------------------------------------------------------------------------- the job on the tier
class ClusterRun(LaunchedJob):
    """A scenario job launched against the tier: the tier's etcd, workers started over ssh on the nodes."""

    def __init__(self, run_dir: Path, cfg: dict[str, Any], cluster: Cluster) -> None:
        super().__init__(run_dir, cfg, flags=(*LAUNCH_FLAGS, *cluster.launch_flags()), env=cluster.launcher_env())
        self.cluster = cluster

    def start(self) -> LaunchedJob:
        if self.cluster.share_nothing:  # every node gets the job's config on its own disk, as from an image
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.config_path.write_text(yaml.safe_dump(self.cfg, sort_keys=False))
            self.cluster.provision(self.config_path)
        return super().start()

    def stop_restarted_agents(self) -> None:
        super().stop_restarted_agents()
        self.cluster.stop_agents()

    def victim(self) -> tuple[int, str]:
        """(node, address) of a node whose worker is not rank 0."""
        host = self.victim_host()
        i = self.cluster.n.node_of(host)
        if i is None:
            raise ScenarioError(f"worker host {host!r} is not a node of the tier")
        return i, host

    def wait_reset_after(self, ts: float, timeout: float = 90) -> None:
        self.wait_for(
            lambda: any(e.ts >= ts for e in of_kind(self.events(), Reset)),
            timeout,
            "a reset after the fault",
        )
