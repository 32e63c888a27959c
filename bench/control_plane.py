"""``control_plane``: etcd, ``discover.sh`` and Horovod's driver with 1,000 hosts registered, simulated.

What runs (one machine):

- one real etcd (:class:`~elastictrain.launcher.etcd.EtcdServer`: free loopback ports, a temporary data dir,
  killed by pid at the end);
- ``hosts - real_agents`` simulated agents in one child process (this module with ``--simulate``): asyncio,
  one gRPC connection per agent through the registry's own aetcd client class. Per heartbeat each makes
  exactly the etcd calls of a steady cycle of :class:`discovery.agent.Agent` (``observe``): a LeaseKeepAlive
  (one stream, one message, as ``EtcdRegistry.keep_alive``) and a Range of its own key (``EtcdRegistry.get``);
  the cycle's action is :func:`discovery.agent.decide` of that observation, and a ``register`` does a
  LeaseGrant and the create-if-absent Txn of ``EtcdRegistry.register`` with a ``HostRecord`` value. The
  agent's defaults: TTL 10 s, then a wait of one heartbeat (3 s) after each cycle;
- churn: ``churn_per_second`` times a second one simulated host leaves, alternately by LeaseRevoke (an
  agent's exit) or by going silent (a dead agent: its key expires with its lease), and a new one joins;
- ``real_agents`` real ``elastictrain agent`` processes started as ``launch`` starts them
  (:func:`~elastictrain.commands.agent_command`, same TTL and heartbeat), ``kills`` of which are
  SIGKILLed one after the other.

Measured, with every host registered: ``discover.sh`` run once a second through the driver's executor
(:func:`~elastictrain.horovod.hvdrun.run_discovery_script`) for ``window_seconds`` (median, p99); etcd's
requests/s by method and gRPC bytes/host/minute from its Prometheus ``/metrics``, for the agents alone
(``quiet_seconds`` without discovery) and with discovery; SIGKILL of a real agent → first ``discover.sh``
output without its host (polled every ``poll_seconds``); Horovod's parse of the discovered lines, the
discovery through our executor, and ``ElasticDriver._update_host_assignments`` (with
:func:`~elastictrain.horovod.hvdrun.install` applied) for every host x 1 slot, cold and after churn;
and a profile of one ``discover.sh`` call by stage.

Goals: ``discover.sh`` p99 <= 150 ms; an agent's death leaves discovery within TTL + 2 s. Alone:
``python -m bench.control_plane [--hosts N] [--seconds S] [--quick]`` prints the result as JSON.

Size: one scenario end to end (the simulated agents' process, the rig of real processes, four measurements and
a profile), kept in one module so that what is simulated reads in one place; its pure parts (Prometheus text,
windows, attribution, the death window) are tested in ``tests/unit/test_bench_control_plane.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.core import BenchContext, BenchError, Goal, Metric, Result, percentile
from chaos.procs import checkout_env
from elastictrain.commands import DISCOVER_SCRIPT

NAME = "control_plane"
MODULE = "bench.control_plane"
DISCOVER_P99_GOAL = Goal("<=", 150.0)
JOB = "cp"


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What one run simulates and measures."""

    hosts: int = 1000
    """Hosts registered in all: simulated agents plus the real ones."""
    real_agents: int = 5
    """Real ``elastictrain agent`` processes."""
    kills: int = 4
    """Real agents SIGKILLed, one after the other."""
    window_seconds: float = 120.0
    """The window in which ``discover.sh`` runs once a second (its p99 comes from this many calls)."""
    quiet_seconds: float = 30.0
    """The window of agents and churn without discovery (the agents' share of etcd's traffic)."""
    churn_per_second: float = 2.0
    """Hosts that leave, and hosts that join, per second."""
    ttl_seconds: int = 10
    heartbeat_seconds: float = 3.0
    poll_seconds: float = 0.25
    """Interval of the ``discover.sh`` poll after a SIGKILL."""
    driver_repeats: int = 20
    seed: int = 24

    def __post_init__(self) -> None:
        if not 1 <= self.real_agents < self.hosts:
            raise ValueError(f"real_agents must be in [1, hosts), got {self.real_agents} of {self.hosts}")
        if not 0 <= self.kills <= self.real_agents:
            raise ValueError(f"kills must be in [0, real_agents], got {self.kills}")
        if self.window_seconds < 5 or self.quiet_seconds < 5:
            raise ValueError("window_seconds and quiet_seconds must be >= 5")

    @property
    def simulated(self) -> int:
        return self.hosts - self.real_agents

    @property
    def death_goal(self) -> Goal:
        return Goal("<=", self.ttl_seconds + 2.0)


QUICK = Plan(real_agents=3, kills=2, window_seconds=40.0, quiet_seconds=15.0, driver_repeats=10)


# --------------------------------------------------------------------------------------------------
# Pure parts: Prometheus text, windows, attribution, deaths


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_prometheus(text: str) -> Samples:
    """Samples of a Prometheus text exposition: ``(name, labels) -> value``; comments and bad lines skipped."""
    out: Samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = frozenset(_LABEL.findall(m.group(2) or ""))
        out[(m.group(1), labels)] = value
    return out


def counter_by(samples: Samples, name: str, label: str, where: Mapping[str, str] | None = None) -> dict[str, float]:
    """Sum of counter ``name`` by the value of ``label`` (``""`` when a sample lacks it), over samples whose
    labels include ``where``."""
    out: dict[str, float] = {}
    for (n, labels), value in samples.items():
        if n != name:
            continue
        d = dict(labels)
        if where and any(d.get(k) != v for k, v in where.items()):
            continue
        key = d.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` per key (a key only in ``after`` counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) != 0}


@dataclass(frozen=True, slots=True)
class Window:
    """etcd's counters over one measured window."""

    seconds: float
    hosts: float
    """Hosts registered on average over the window."""
    requests: dict[str, float]
    """gRPC calls started, by method (a LeaseKeepAlive stream counts once)."""
    received_bytes: float
    sent_bytes: float

    @classmethod
    def between(cls, before: Samples, after: Samples, seconds: float, hosts: float) -> Window:
        def total(s: Samples, name: str) -> float:
            return sum(counter_by(s, name, "").values())

        return cls(
            seconds=seconds,
            hosts=hosts,
            requests=delta(
                counter_by(before, "grpc_server_started_total", "grpc_method"),
                counter_by(after, "grpc_server_started_total", "grpc_method"),
            ),
            received_bytes=total(after, "etcd_network_client_grpc_received_bytes_total")
            - total(before, "etcd_network_client_grpc_received_bytes_total"),
            sent_bytes=total(after, "etcd_network_client_grpc_sent_bytes_total")
            - total(before, "etcd_network_client_grpc_sent_bytes_total"),
        )

    def per_second(self) -> dict[str, float]:
        """Requests per second by method, and ``total``."""
        rates = {k: v / self.seconds for k, v in sorted(self.requests.items())}
        rates["total"] = sum(self.requests.values()) / self.seconds
        return rates

    def bytes_per_host_minute(self) -> float:
        """gRPC payload bytes (both directions) per registered host per minute."""
        return (self.received_bytes + self.sent_bytes) / self.hosts / (self.seconds / 60.0)

    def share(self, base: Window) -> dict[str, float]:
        """What this window added over ``base`` (a window of the same load without one client), per second:
        ``requests_per_second`` and ``bytes_per_second`` (both directions)."""
        mine, theirs = self.per_second(), base.per_second()
        return {
            "requests_per_second": mine["total"] - theirs["total"],
            "bytes_per_second": (self.received_bytes + self.sent_bytes) / self.seconds
            - (base.received_bytes + base.sent_bytes) / base.seconds,
        }


def gone_after(kill_at: float, polls: Sequence[tuple[float, float, bool]]) -> tuple[float, float] | None:
    """When a killed host left discovery, from polls ``(started, ended, listed)`` (monotonic seconds).

    Returns ``(low, high)`` seconds after ``kill_at``: the first poll started after the kill that no longer
    lists the host ended at ``high``, and the last poll before it that listed the host started at ``low``
    (or the kill itself), so the host left within ``[low, high]``. None when every poll lists it.
    """
    low = 0.0
    for started, ended, listed in sorted(polls):
        if started < kill_at:
            continue
        if listed:
            low = started - kill_at
        else:
            return low, ended - kill_at
    return None


def stats_ms(values: Sequence[float]) -> dict[str, Any]:
    """Median, p99 (nearest rank), min, max and n of values in milliseconds."""
    if not values:
        return {"n": 0, "median": None, "p99": None, "min": None, "max": None}
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
    }


# --------------------------------------------------------------------------------------------------
# The simulated agents (child process)


class _Sim:
    """Simulated agents on one event loop: the calls of ``Agent.observe`` and ``Agent.apply`` per cycle."""

    def __init__(self, endpoint: str, plan: Plan) -> None:
        from discovery.endpoints import parse_endpoints

        self.ep = parse_endpoints(endpoint)[0]
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.next_index = 0
        self.live: dict[int, asyncio.Task[None]] = {}
        self.leaving: set[asyncio.Task[None]] = set()
        self.registered: set[int] = set()
        self.actions: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.cycle_ms: list[float] = []
        self.joins = self.revoked = self.silenced = 0
        self.stopping = False

    def client(self) -> Any:
        from discovery.registry import _client_class

        timeout = min(2.0, self.plan.ttl_seconds / 6)
        return _client_class()(
            host=self.ep.host,
            port=self.ep.port,
            timeout=max(1, round(timeout)),
            # as EtcdRegistry, plus a connection of its own per agent (grpc shares them within a process otherwise)
            options={
                "grpc.initial_reconnect_backoff_ms": 100,
                "grpc.max_reconnect_backoff_ms": 1000,
                "grpc.use_local_subchannel_pool": 1,
            },
        )

    def start_agent(self, delay: float) -> None:
        i = self.next_index
        self.next_index += 1
        self.live[i] = asyncio.get_running_loop().create_task(self.agent(i, delay))

    async def agent(self, i: int, delay: float) -> None:
        from discovery.agent import Action, AgentConfig, AgentState, Observation, decide
        from discovery.record import READY, HostRecord

        p = self.plan
        timeout = min(2.0, p.ttl_seconds / 6)
        cfg = AgentConfig(
            job=JOB,
            host=f"sim-{i:05d}",
            slots=1,
            addr=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",
            ttl_seconds=p.ttl_seconds,
            heartbeat_seconds=p.heartbeat_seconds,
            request_timeout_seconds=timeout,
        )
        key = f"/elastictrain/{JOB}/hosts/{cfg.host}".encode()
        st = AgentState()
        c = self.client()
        try:
            await asyncio.sleep(delay)
            while not self.stopping:
                t0 = time.monotonic()
                lease_alive = lease_lost = False
                try:
                    if st.lease_id is not None:
                        reply = await asyncio.wait_for(c.refresh_lease(st.lease_id), timeout)
                        if reply is None or reply.TTL <= 0:
                            st.lease_id, st.registered, lease_lost = None, False, True
                        else:
                            lease_alive = True
                    kv = await asyncio.wait_for(c.get(key), timeout)
                except Exception as e:  # counted; the next cycle tries again, as the agent does
                    self.errors[type(e).__name__] += 1
                    await asyncio.sleep(p.heartbeat_seconds)
                    continue
                record = HostRecord.from_json(cfg.host, kv.value) if kv is not None else None
                obs = Observation(
                    now=t0,
                    wall_time=time.time(),
                    lease_alive=lease_alive,
                    lease_lost=lease_lost,
                    key_state=record.state if record else None,
                    key_lease=int(kv.lease) if kv is not None else 0,
                    key_pid=record.pid if record else 0,
                )
                decision = decide(cfg, st, obs)
                self.actions[decision.action.value] += 1
                if decision.action is Action.REGISTER:
                    lease = await asyncio.wait_for(c.lease(p.ttl_seconds), timeout)
                    value = HostRecord(
                        host=cfg.host, slots=1, addr=cfg.addr, state=READY, pid=os.getpid(), registered_at=time.time()
                    ).to_json()
                    ok, _ = await asyncio.wait_for(
                        c.transaction(
                            compare=[c.transactions.create(key) == 0],
                            success=[c.transactions.put(key, value, lease=lease.id)],
                            failure=[],
                        ),
                        timeout,
                    )
                    if ok:
                        st.lease_id, st.registered = int(lease.id), True
                        self.registered.add(i)
                    else:
                        await c.revoke_lease(lease.id)
                self.cycle_ms.append((time.monotonic() - t0) * 1000.0)
                await asyncio.sleep(p.heartbeat_seconds)
        except asyncio.CancelledError:
            if st.lease_id is not None and getattr(asyncio.current_task(), "revoke", False):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(c.revoke_lease(st.lease_id), timeout)
            raise
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c.close(), 1.0)

    def leave(self, revoke: bool) -> None:
        """One host leaves: its lease revoked (an agent's exit) or, when not ``revoke``, it just stops (a death)."""
        i = self.rng.choice(sorted(self.live))
        task = self.live.pop(i)
        self.registered.discard(i)
        task.revoke = revoke  # type: ignore[attr-defined]
        task.cancel()  # it revokes (or not) and closes its connection on its own time; the churn goes on
        self.leaving.add(task)
        task.add_done_callback(self.leaving.discard)
        if revoke:
            self.revoked += 1
        else:
            self.silenced += 1

    async def run(self, ready: Callable[[], None], stop: threading.Event) -> None:
        p = self.plan
        for _ in range(p.simulated):
            self.start_agent(self.rng.uniform(0, p.heartbeat_seconds))
        deadline = time.monotonic() + 60 + p.simulated / 20
        while len(self.registered) < p.simulated:
            if time.monotonic() > deadline:
                raise BenchError(f"only {len(self.registered)} of {p.simulated} simulated hosts registered")
            await asyncio.sleep(0.1)
        ready()
        period = 1.0 / p.churn_per_second if p.churn_per_second > 0 else None
        revoke = True
        next_churn = time.monotonic()
        while not stop.is_set():
            if period is not None and time.monotonic() >= next_churn:
                self.leave(revoke)
                revoke = not revoke
                self.start_agent(0.0)
                self.joins += 1
                next_churn += period
            await asyncio.sleep(0.05)
        self.stopping = True

    def stats(self) -> dict[str, Any]:
        return {
            "simulated_agents": self.plan.simulated,
            "cycles": len(self.cycle_ms),
            "actions": dict(self.actions),
            "errors": dict(self.errors),
            "joins": self.joins,
            "left_by_revoke": self.revoked,
            "left_by_expiry": self.silenced,
            "cycle_ms": stats_ms(self.cycle_ms),
        }


def simulate_main(endpoint: str, plan: Plan) -> int:
    """The child process: print ``ready`` once every simulated host is registered; on SIGTERM, print the stats
    as one JSON line and exit at once (leases left to expire: etcd is killed next)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    sim = _Sim(endpoint, plan)

    def ready() -> None:
        sys.stdout.write("ready\n")
        sys.stdout.flush()

    loop = asyncio.new_event_loop()
    loop.run_until_complete(sim.run(ready, stop))
    sys.stdout.write(json.dumps(sim.stats()) + "\n")
    sys.stdout.flush()
    os._exit(0)  # no orderly close of a thousand gRPC channels


# --------------------------------------------------------------------------------------------------
# The measurement (parent process)


class _Discover:
    """``discover.sh`` as horovodrun's driver runs it: a shell command line through our executor."""

    def __init__(self, endpoint: str, cache: Path) -> None:
        env = {"ELASTICTRAIN_ETCD": endpoint, "ELASTICTRAIN_JOB": JOB, "ELASTICTRAIN_DISCOVER_CACHE": str(cache)}
        self.env = env
        self.script = (
            " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + f" {shlex.quote(str(DISCOVER_SCRIPT))}"
        )

    def call(self) -> tuple[float, float, list[str]]:
        """``(started, ended, lines)``, monotonic seconds; RuntimeError when the script fails."""
        from elastictrain.horovod.hvdrun import run_discovery_script

        t0 = time.monotonic()
        out = run_discovery_script(self.script, timeout=10.0)
        return t0, time.monotonic(), out.split()


def scrape(endpoint: str) -> Samples:
    with urllib.request.urlopen(f"{endpoint}/metrics", timeout=5) as resp:
        return parse_prometheus(resp.read().decode())


def _cpu_seconds(pid: int) -> float:
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


class _Rig:
    """etcd, the simulator child and the real agents, started and ended by pid."""

    def __init__(self, plan: Plan, root: Path, progress: Callable[[str], None]) -> None:
        from elastictrain.launcher.etcd import EtcdServer

        self.plan = plan
        self.root = root
        self.progress = progress
        self.etcd = EtcdServer(root / "etcd-data", root / "etcd.log", name="bench")
        self.sim: subprocess.Popen[str] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.discover = _Discover(self.etcd.endpoint, root / "discover-cache.json")
        self.sim_stats: dict[str, Any] = {}

    def start(self) -> None:
        p = self.plan
        self.etcd.start()
        self.progress(f"etcd at {self.etcd.endpoint} (pid {self.etcd.pid}); {p.simulated} simulated agents registering")
        self.sim = subprocess.Popen(
            [sys.executable, "-m", MODULE, "--simulate", self.etcd.endpoint, "--plan", json.dumps(asdict(p))],
            stdout=subprocess.PIPE,
            stderr=(self.root / "sim.log").open("ab"),
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            env=checkout_env(),
        )
        assert self.sim.stdout is not None
        line = self.sim.stdout.readline()  # the child prints "ready" or exits (its own deadline)
        if line.strip() != "ready":
            raise BenchError(f"simulator exited before its hosts registered: {self._sim_log_tail()}")
        self.progress(f"{p.simulated} simulated hosts registered; starting {p.real_agents} real agents")
        from elastictrain.commands import agent_command
        from elastictrain.config import DiscoveryConfig

        cfg = DiscoveryConfig(ttl_seconds=float(p.ttl_seconds), heartbeat_seconds=p.heartbeat_seconds)
        for k in range(p.real_agents):
            host = f"real-{k}"
            cmd = agent_command(cfg, etcd=self.etcd.endpoint, job=JOB, host=host, drain_grace_seconds=0.0)
            with (self.root / f"agent-{host}.log").open("ab") as log:
                self.agents[host] = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        deadline = time.monotonic() + 60
        while True:
            listed = set(self.listed())
            if all(f"{h}:1" in listed for h in self.agents):
                return
            dead = [h for h, proc in self.agents.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise BenchError(f"real agents {dead or sorted(self.agents)} not listed by discover.sh")
            time.sleep(0.2)

    def listed(self) -> list[str]:
        return self.discover.call()[2]

    def _sim_log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.root / "sim.log").read_text()[-600:].strip().replace("\n", " | ")
        return "<no log>"

    def stop(self) -> None:
        for proc in self.agents.values():  # SIGTERM twice: drain, then revoke at once
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
                    os.kill(proc.pid, signal.SIGTERM)
        if self.sim is not None and self.sim.poll() is None:
            os.kill(self.sim.pid, signal.SIGTERM)
            try:
                out, _ = self.sim.communicate(timeout=30)
                self.sim_stats = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
            except (subprocess.TimeoutExpired, ValueError):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.sim.pid, signal.SIGKILL)
                self.sim.wait()
        for proc in self.agents.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        self.etcd.kill()


def _window(rig: _Rig, seconds: float, during: Callable[[float], None] | None) -> tuple[Window, dict[str, float]]:
    """etcd's counters and the CPU of etcd and the simulator over ``seconds``; ``during(deadline)`` runs meanwhile
    and returns by the deadline. Hosts registered: the mean of etcd's key count at both ends (only host keys exist)."""
    assert rig.sim is not None and rig.etcd.pid is not None
    pids = {"etcd": rig.etcd.pid, "simulator": rig.sim.pid}
    before = scrape(rig.etcd.endpoint)
    cpu0 = {k: _cpu_seconds(pid) for k, pid in pids.items()}
    t0 = time.monotonic()
    deadline = t0 + seconds
    if during is not None:
        during(deadline)
    time.sleep(max(0.0, deadline - time.monotonic()))  # the window's length, not a synchronization
    elapsed = time.monotonic() - t0
    after = scrape(rig.etcd.endpoint)
    cpu = {k: (_cpu_seconds(pid) - cpu0[k]) / elapsed for k, pid in pids.items()}
    keys = [sum(counter_by(s, "etcd_debugging_mvcc_keys_total", "").values()) for s in (before, after)]
    hosts = statistics.mean(keys) if all(keys) else float(rig.plan.hosts)
    return Window.between(before, after, elapsed, hosts), cpu


def _discover_loop(rig: _Rig, calls: list[dict[str, float]]) -> Callable[[float], None]:
    """``during`` of the discovery window: a call, then a wait of 1 s, as Horovod's driver loop does."""

    def run(deadline: float) -> None:
        while time.monotonic() < deadline - 1.0:
            cpu0 = os.times()
            started, ended, lines = rig.discover.call()
            cpu1 = os.times()
            cpu = cpu1.children_user + cpu1.children_system - cpu0.children_user - cpu0.children_system
            calls.append({"ms": (ended - started) * 1000.0, "cpu_ms": cpu * 1000.0, "hosts": len(lines)})
            time.sleep(1.0)

    return run


def measure_deaths(rig: _Rig, rng: random.Random) -> list[dict[str, Any]]:
    """SIGKILL ``plan.kills`` real agents one after the other, each at a random point of its heartbeat period,
    and poll ``discover.sh`` until its host is gone."""
    p = rig.plan
    out = []
    for host in sorted(rig.agents)[: p.kills]:
        proc = rig.agents[host]
        time.sleep(rng.uniform(0, p.heartbeat_seconds))  # a random phase of the heartbeat, not a synchronization
        kill_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        polls: list[tuple[float, float, bool]] = []
        deadline = kill_at + p.ttl_seconds + 20
        while time.monotonic() < deadline:
            started, ended, lines = rig.discover.call()
            polls.append((started, ended, f"{host}:1" in lines))
            if not polls[-1][2]:
                break
            time.sleep(max(0.0, started + p.poll_seconds - time.monotonic()))
        found = gone_after(kill_at, polls)
        if found is None:
            raise BenchError(f"{host} still listed by discover.sh {p.ttl_seconds + 20} s after its agent's SIGKILL")
        out.append({"host": host, "gone_within_s": [found[0], found[1]], "seconds": found[1], "polls": len(polls)})
        rig.progress(f"SIGKILL {host} -> gone from discover.sh after {found[0]:.2f}-{found[1]:.2f} s")
    return out


def measure_driver(rig: _Rig, repeats: int, rng: random.Random) -> dict[str, Any]:
    """Horovod's side at this many hosts, as our wrapper runs it (``hvdrun.install()``): the discovery through
    our executor and its parse, and ``ElasticDriver._update_host_assignments`` cold and after churn."""
    from horovod.runner.elastic.discovery import FixedHosts, HostDiscoveryScript
    from horovod.runner.elastic.driver import ElasticDriver
    from horovod.runner.elastic.rendezvous import create_rendezvous_handler
    from horovod.runner.http.http_server import RendezvousServer

    from elastictrain.horovod.hvdrun import install, run_discovery_script

    install()
    script = HostDiscoveryScript(rig.discover.script, 1)
    find_ms, parse_ms = [], []
    host_slots: dict[str, int] = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        host_slots = script.find_available_hosts_and_slots()
        find_ms.append((time.perf_counter() - t0) * 1000.0)
    text = run_discovery_script(rig.discover.script)
    captured = HostDiscoveryScript("true", 1)
    captured._execute_discovery_script = lambda: text
    for _ in range(repeats):
        t0 = time.perf_counter()
        captured.find_available_hosts_and_slots()
        parse_ms.append((time.perf_counter() - t0) * 1000.0)

    fixed = FixedHosts(dict(host_slots))
    rendezvous = RendezvousServer()
    driver = ElasticDriver(rendezvous, fixed, min_num_proc=1, max_num_proc=len(host_slots) + 100)
    rendezvous.start(create_rendezvous_handler(driver))
    update_ms, assign_ms = [], []
    try:
        current = driver.wait_for_available_slots(len(host_slots))
        t0 = time.perf_counter()
        driver._update_host_assignments(current)
        cold_ms = (time.perf_counter() - t0) * 1000.0
        world_cold = driver.world_size()
        for r in range(repeats):
            hosts = dict(fixed.find_available_hosts_and_slots())
            for gone in rng.sample(sorted(hosts), 2):
                del hosts[gone]
            hosts.update({f"join-{r}-{k}": 1 for k in range(2)})
            with driver._wait_hosts_cond:  # the driver's discovery thread takes this lock for the same step
                fixed.set(hosts)
                t0 = time.perf_counter()
                driver._host_manager.update_available_hosts()
                t1 = time.perf_counter()
                driver._update_host_assignments(driver._host_manager.current_hosts)
                t2 = time.perf_counter()
            update_ms.append((t1 - t0) * 1000.0)
            assign_ms.append((t2 - t1) * 1000.0)
    finally:
        driver.stop()
    return {
        "hosts": len(host_slots),
        "world_size_cold": world_cold,
        "find_available_hosts_and_slots_ms": stats_ms(find_ms),
        "parse_ms": stats_ms(parse_ms),
        "update_host_assignments_cold_ms": cold_ms,
        "update_host_assignments_churn_ms": stats_ms(assign_ms),
        "host_manager_update_ms": stats_ms(update_ms),
    }


def profile_discover(rig: _Rig, repeats: int = 10) -> dict[str, Any]:
    """Where one ``discover.sh`` call's time goes at this many hosts: the interpreter's start, the imports, and
    (in this process) etcd's range reply, JSON, base64, the per-host checks, the output and the cache."""
    import base64

    from discovery import discover, wire
    from discovery.endpoints import EtcdAccess, parse_endpoints

    def ms(fn: Callable[[], object], n: int = repeats) -> dict[str, float]:
        """Median wall and CPU time; the CPU of a child process is counted in clock ticks (10 ms)."""
        wall, cpu = [], []
        for _ in range(n):
            w, c, t = time.perf_counter(), time.process_time(), os.times()
            fn()
            wall.append((time.perf_counter() - w) * 1000.0)
            e = os.times()
            cpu.append((time.process_time() - c + e.children_user + e.children_system - t[2] - t[3]) * 1000.0)
        return {"wall_ms": statistics.median(wall), "cpu_ms": statistics.median(cpu)}

    env = {**os.environ, **rig.discover.env, "PYTHONPATH": str(DISCOVER_SCRIPT.parents[1])}
    python = [sys.executable, "-S"]
    cached = {**env, "PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(rig.root / "pycache")}
    subprocess.run([*python, "-c", "import discovery.discover"], env=cached, check=True)  # writes the bytecode
    out: dict[str, Any] = {
        "python_start": ms(lambda: subprocess.run([*python, "-c", "pass"], check=True), 5),
        # compiled at each start, as under PYTHONDONTWRITEBYTECODE without discover.sh's bytecode cache
        "python_start_and_imports": ms(
            lambda: subprocess.run([*python, "-c", "import discovery.discover"], env=env, check=True), 5
        ),
        # from the bytecode cache, as discover.sh runs it
        "python_start_and_imports_cached": ms(
            lambda: subprocess.run([*python, "-c", "import discovery.discover"], env=cached, check=True), 5
        ),
    }
    ep = parse_endpoints(rig.etcd.endpoint)[0]
    session = discover.Session(EtcdAccess(), 5.0)
    start = wire.hosts_prefix(wire.DEFAULT_PREFIX, JOB)
    body = json.dumps(
        {
            "key": base64.b64encode(start.encode()).decode(),
            "range_end": base64.b64encode(start[:-1].encode() + b"0").decode(),
        }
    ).encode()
    raw = discover._post(ep, "/v3/kv/range", body, 5.0, session, None)
    reply = json.loads(raw)
    pairs = [(base64.b64decode(kv["key"]).decode(), base64.b64decode(kv.get("value", ""))) for kv in reply["kvs"]]
    records = [wire.parse_value(k[len(start) :], v) for k, v in pairs]
    lines = wire.discovery_lines(records)
    clock = discover.Clock.now()
    out.update(
        {
            "reply_bytes": len(raw),
            "hosts": len(pairs),
            "etcd_range_round_trip": ms(lambda: discover._post(ep, "/v3/kv/range", body, 5.0, session, None)),
            "json_reply": ms(lambda: json.loads(raw)),
            "base64": ms(
                lambda: [(base64.b64decode(kv["key"]), base64.b64decode(kv.get("value", ""))) for kv in reply["kvs"]]
            ),
            "parse_values": ms(lambda: [wire.parse_value(k[len(start) :], v) for k, v in pairs]),
            "lines": ms(lambda: wire.discovery_lines(wire.drop_case_duplicates(records, lambda r: r["host"])[0])),
            "cache_write": ms(lambda: discover.write_cache(str(rig.root / "profile-cache.json"), JOB, lines, clock)),
            "run_in_process": ms(
                lambda: discover.run({**rig.discover.env, "ELASTICTRAIN_DISCOVER_CACHE": str(rig.root / "p.json")})
            ),
        }
    )
    return out


def measure(plan: Plan, root: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run the whole scenario once; every number in one dict (see the module docstring)."""
    rng = random.Random(plan.seed)
    rig = _Rig(plan, root, progress)
    out: dict[str, Any] = {"plan": asdict(plan)}
    try:
        rig.start()
        progress(f"{plan.hosts} hosts registered; agents and churn alone for {plan.quiet_seconds:g} s")
        quiet, quiet_cpu = _window(rig, plan.quiet_seconds, None)
        calls: list[dict[str, float]] = []
        progress(f"discover.sh once a second for {plan.window_seconds:g} s")
        busy, busy_cpu = _window(rig, plan.window_seconds, _discover_loop(rig, calls))
        progress(
            f"discover.sh median {statistics.median(c['ms'] for c in calls):.0f} ms, "
            f"p99 {percentile([c['ms'] for c in calls], 99):.0f} ms over {len(calls)} calls; "
            f"etcd {busy.per_second()['total']:.0f} requests/s"
        )
        out["deaths"] = measure_deaths(rig, rng)
        progress("Horovod's driver at this many hosts")
        out["driver"] = measure_driver(rig, plan.driver_repeats, rng)
        progress("profile of one discover.sh call")
        out["discover_profile"] = profile_discover(rig)
        progress("profiled")
    finally:
        t0 = time.monotonic()
        rig.stop()
        progress(f"stopped in {time.monotonic() - t0:.1f} s")
    out["simulator"] = rig.sim_stats
    out["discover_calls"] = calls
    out["discover_ms"] = stats_ms([c["ms"] for c in calls])
    out["discover_cpu_ms"] = stats_ms([c["cpu_ms"] for c in calls])
    out["hosts_listed"] = {"min": min(c["hosts"] for c in calls), "max": max(c["hosts"] for c in calls)}
    out["etcd"] = {
        name: {
            "seconds": w.seconds,
            "hosts": w.hosts,
            "requests_per_second": w.per_second(),
            "bytes_per_host_minute": w.bytes_per_host_minute(),
            "received_bytes": w.received_bytes,
            "sent_bytes": w.sent_bytes,
            "cpu_cores": cpu,
        }
        for name, w, cpu in (("agents", quiet, quiet_cpu), ("agents_and_discovery", busy, busy_cpu))
    }
    share = busy.share(quiet)
    calls_per_second = len(calls) / busy.seconds
    out["etcd"]["discovery_share"] = {
        "requests_per_second": calls_per_second,  # one Range (through etcd's JSON gateway) per call
        "bytes_per_second": share["bytes_per_second"],
        "bytes_per_call": share["bytes_per_second"] / calls_per_second if calls_per_second else None,
        "bytes_per_host_minute": share["bytes_per_second"] * 60.0 / busy.hosts,
    }
    return out


def to_result(r: dict[str, Any]) -> Result:
    """The bench result of one :func:`measure` dict."""
    plan = Plan(**r["plan"])
    n = plan.hosts
    d, drv, etcd = r["discover_ms"], r["driver"], r["etcd"]
    deaths = [x["seconds"] for x in r["deaths"]]
    agents, share = etcd["agents"], etcd["discovery_share"]
    by_method = ", ".join(f"{k} {v:.0f}" for k, v in agents["requests_per_second"].items() if k != "total")
    metrics = [
        Metric(
            f"discover.sh p99, {n} hosts",
            d["p99"],
            "ms",
            DISCOVER_P99_GOAL,
            note=f"median {d['median']:.0f} ms, {d['n']} calls",
        ),
        Metric(f"discover.sh median, {n} hosts", d["median"], "ms"),
        Metric(
            "agent SIGKILL -> gone from discover.sh, max",
            max(deaths) if deaths else None,
            "s",
            plan.death_goal,
            note=", ".join(f"{s:.1f}" for s in deaths),
        ),
        Metric("etcd requests/s, agents + churn", agents["requests_per_second"]["total"], "req/s", note=by_method),
        Metric("etcd requests/s, discovery", share["requests_per_second"], "req/s"),
        Metric("etcd gRPC bytes per host per minute, agents", agents["bytes_per_host_minute"], "B"),
        Metric("etcd gRPC bytes per host per minute, discovery", share["bytes_per_host_minute"], "B"),
        Metric(
            f"driver _update_host_assignments, {n} hosts, after churn, median",
            drv["update_host_assignments_churn_ms"]["median"],
            "ms",
            note=f"cold {drv['update_host_assignments_cold_ms']:.1f} ms",
        ),
        Metric(f"Horovod parse of {drv['hosts']} discovery lines, median", drv["parse_ms"]["median"], "ms"),
        Metric(
            "HostDiscoveryScript through our executor, median", drv["find_available_hosts_and_slots_ms"]["median"], "ms"
        ),
    ]
    return Result(
        NAME,
        metrics=metrics,
        contenders={
            "discover.sh": {**d, "unit": "ms"},
            "agent death": {"median": statistics.median(deaths) if deaths else None, "unit": "s"},
        },
        detail=r,
    )


def run(ctx: BenchContext) -> Result:
    plan = QUICK if ctx.quick else Plan()
    return to_result(measure(plan, ctx.scratch("control-plane"), ctx.progress))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--hosts", type=int, default=None, help="hosts registered in all (default 1000)")
    p.add_argument("--seconds", type=float, default=None, help="the discover.sh window (default 120; quick 40)")
    p.add_argument("--quick", action="store_true", help="shorter windows, fewer kills (under 3 minutes)")
    p.add_argument("--simulate", metavar="ENDPOINT", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.simulate:
        return simulate_main(args.simulate, Plan(**json.loads(args.plan)))
    plan = QUICK if args.quick else Plan()
    with contextlib.suppress(TypeError):
        plan = replace(
            plan, **{k: v for k, v in (("hosts", args.hosts), ("window_seconds", args.seconds)) if v is not None}
        )
    import shutil
    import tempfile

    from bench.core import Progress

    root = Path(tempfile.mkdtemp(prefix="elastictrain-control-plane-"))
    try:
        result = to_result(measure(plan, root, Progress()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sys.stdout.write(json.dumps(result.to_dict(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
