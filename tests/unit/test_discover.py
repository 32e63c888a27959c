"""discover.py without a network: etcd replies are faked, the cache lives in tmp_path."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from discovery import discover
from discovery.endpoints import Endpoint
from discovery.hosts_cli import format_age, format_table
from discovery.record import DRAINING, HostRecord
from discovery.registry import Entry, Listing

PREFIX = "/elastictrain/job1/hosts/"


def value(slots: int = 1, state: str = "ready") -> bytes:
    return json.dumps({"slots": slots, "addr": "127.0.0.1", "state": state, "pid": 1, "registered_at": 0}).encode()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {
        "ELASTICTRAIN_ETCD": "http://127.0.0.1:2379",
        "ELASTICTRAIN_JOB": "job1",
        "ELASTICTRAIN_DISCOVER_CACHE": str(tmp_path / "cache" / "discover-job1.json"),
        "ELASTICTRAIN_DISCOVER_STALENESS": "30",
    }


def fake_etcd(monkeypatch: pytest.MonkeyPatch, pairs: list[tuple[str, bytes]] | None) -> None:
    def range_prefix(session: discover.Session, ep: Endpoint, prefix: str) -> list[tuple[str, bytes]]:
        assert prefix == PREFIX
        if pairs is None:
            raise ConnectionRefusedError("connection refused")
        return pairs

    monkeypatch.setattr(discover, "range_prefix", range_prefix)


def test_prints_sorted_ready_hosts_and_skips_draining(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    fake_etcd(monkeypatch, [(PREFIX + "zeta", value(2)), (PREFIX + "alpha", value(1)),
                            (PREFIX + "mid", value(4, DRAINING))])  # fmt: skip
    assert discover.run(env) == (0, ["alpha:1", "zeta:2"], [])


def test_malformed_values_are_skipped_with_a_warning(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    fake_etcd(monkeypatch, [(PREFIX + "good", value(1)), (PREFIX + "bad", b"\xff garbage"),
                            (PREFIX + "zero", value(0)), (PREFIX + "a:b", value(1))])  # fmt: skip
    code, out, err = discover.run(env)
    assert (code, out) == (0, ["good:1"])
    assert len(err) == 3 and all(line.startswith("discover: warning: skipping malformed value") for line in err)


def test_outage_serves_the_cache_within_the_window_then_fails(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    fake_etcd(monkeypatch, [(PREFIX + "a", value(1)), (PREFIX + "b", value(2))])
    assert discover.run(env)[0] == 0
    cache = Path(env["ELASTICTRAIN_DISCOVER_CACHE"])
    written = cache.stat().st_mtime
    fake_etcd(monkeypatch, None)
    code, out, err = discover.run(env, now=written + 29)
    assert (code, out) == (0, ["a:1", "b:2"])
    assert err == ["discover: warning: etcd unreachable; serving membership cached 29.0s ago"]
    code, out, err = discover.run(env, now=written + 31)
    assert (code, out) == (1, [])
    assert len(err) == 1 and "cached membership of job 'job1' is 31s old" in err[0]


def test_unchanged_membership_only_touches_the_cache(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    fake_etcd(monkeypatch, [(PREFIX + "a", value(1))])
    discover.run(env)
    cache = Path(env["ELASTICTRAIN_DISCOVER_CACHE"])
    os.utime(cache, (1.0, 1.0))
    inode = cache.stat().st_ino
    discover.run(env)
    assert cache.stat().st_ino == inode and cache.stat().st_mtime > 1.0
    fake_etcd(monkeypatch, [(PREFIX + "a", value(1)), (PREFIX + "b", value(1))])
    discover.run(env)
    assert json.loads(cache.read_text()) == {"job": "job1", "hosts": ["a:1", "b:1"]}
    assert [p.name for p in cache.parent.iterdir()] == [cache.name], "no temp file left behind"


def test_outage_without_a_cache_fails_with_one_line(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    fake_etcd(monkeypatch, None)
    code, out, err = discover.run(env)
    assert (code, out) == (1, []) and len(err) == 1 and "no cached membership" in err[0]


def test_a_cache_of_another_job_is_not_served(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    cache = Path(env["ELASTICTRAIN_DISCOVER_CACHE"])
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"job": "other", "hosts": ["x:1"]}))
    fake_etcd(monkeypatch, None)
    assert discover.run(env)[0] == 1


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"ELASTICTRAIN_ETCD": ""}, "ELASTICTRAIN_ETCD is not set"),
        ({"ELASTICTRAIN_ETCD": "ftp://x:1"}, "invalid etcd endpoint"),
        ({"ELASTICTRAIN_JOB": ""}, "ELASTICTRAIN_JOB must name the job"),
        ({"ELASTICTRAIN_DISCOVER_STALENESS": "soon"}, "ELASTICTRAIN_DISCOVER_STALENESS must be a number"),
    ],
)
def test_bad_environment_exits_2(env: dict[str, str], change: dict[str, str], match: str) -> None:
    code, out, err = discover.run({**env, **change})
    assert (code, out) == (2, []) and len(err) == 1 and match in err[0]


def test_default_cache_path_follows_xdg(env: dict[str, str]) -> None:
    del env["ELASTICTRAIN_DISCOVER_CACHE"]
    cfg = discover.DiscoverConfig.from_env({**env, "XDG_CACHE_HOME": "/c"})
    assert cfg.cache_path == "/c/elastictrain/discover-job1.json"
    assert cfg.endpoints == [Endpoint("http", "127.0.0.1", 2379)]


def test_hosts_table_has_host_slots_state_age() -> None:
    r = HostRecord(host="node-a", slots=4, addr="10.0.0.1", state=DRAINING, pid=9, registered_at=1000.0)
    lines = format_table(Listing([Entry(r, 5, 1)]), now=1000.0 + 7325)
    assert lines[0].split() == ["HOST", "SLOTS", "STATE", "AGE", "PID", "ADDR"]
    assert lines[1].split() == ["node-a", "4", "draining", "2h02m", "9", "10.0.0.1"]
    assert [format_age(s) for s in (5, 300, 200000)] == ["5s", "5m", "2d"]
