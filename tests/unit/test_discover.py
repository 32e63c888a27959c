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


def stamp(cache: Path) -> dict:
    return json.loads(cache.read_text())["read_at"]


def test_outage_serves_the_cache_within_the_window_then_fails(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    fake_etcd(monkeypatch, [(PREFIX + "a", value(1)), (PREFIX + "b", value(2))])
    assert discover.run(env, discover.Clock(1000.0, 50.0, "boot-1"))[0] == 0
    fake_etcd(monkeypatch, None)
    code, out, err = discover.run(env, discover.Clock(1000.0, 50.0 + 29, "boot-1"))
    assert (code, out) == (0, ["a:1", "b:2"])
    assert err == ["discover: warning: etcd unreachable; serving membership cached 29.0s ago"]
    code, out, err = discover.run(env, discover.Clock(1000.0, 50.0 + 31, "boot-1"))
    assert (code, out) == (1, [])
    assert len(err) == 1 and "cached membership of job 'job1' is 31s old" in err[0]


def test_during_an_outage_a_cache_file_owned_by_another_user_is_not_served(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    fake_etcd(monkeypatch, [(PREFIX + "a", value(1))])
    clock = discover.Clock(1000.0, 50.0, "boot-1")
    assert discover.run(env, clock)[0] == 0
    fake_etcd(monkeypatch, None)
    owner = Path(env["ELASTICTRAIN_DISCOVER_CACHE"]).stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)  # as if another user had written (or replaced) the file
    code, out, err = discover.run(env, clock)
    assert (code, out) == (1, [])
    assert len(err) == 1 and f"is owned by uid {owner}, not by this user (uid {owner + 1})" in err[0], err


def test_cache_age_ignores_the_files_mtime_that_a_skewed_nfs_server_sets(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    fake_etcd(monkeypatch, [(PREFIX + "a", value(1))])
    assert discover.run(env, discover.Clock(5000.0, 100.0, "boot-1"))[0] == 0
    cache = Path(env["ELASTICTRAIN_DISCOVER_CACHE"])
    fake_etcd(monkeypatch, None)
    for server_skew in (-3600.0, +3600.0):  # the file server's clock an hour behind, then ahead
        os.utime(cache, (5000.0 + server_skew, 5000.0 + server_skew))
        code, out, err = discover.run(env, discover.Clock(5010.0, 110.0, "boot-1"))
        assert (code, out) == (0, ["a:1"]) and err[-1].endswith("cached 10.0s ago")
    # Our own wall clock stepped an hour back (NTP): the monotonic clock of the same boot still says 40s.
    code, out, err = discover.run(env, discover.Clock(5000.0 - 3600, 140.0, "boot-1"))
    assert code == 1 and "is 40s old" in err[0]
    # After a reboot the monotonic stamp means nothing: the writer's wall time is used.
    code, out, err = discover.run(env, discover.Clock(5020.0, 3.0, "boot-2"))
    assert (code, out) == (0, ["a:1"]) and err[-1].endswith("cached 20.0s ago")
    # A stamp from the future is not trusted.
    code, out, err = discover.run(env, discover.Clock(4000.0, 3.0, "boot-2"))
    assert code == 1 and "of unknown age" in err[0]


def test_each_answer_restamps_the_cache_and_leaves_no_temp_file(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    fake_etcd(monkeypatch, [(PREFIX + "a", value(1))])
    discover.run(env, discover.Clock(1.0, 1.0, "b"))
    cache = Path(env["ELASTICTRAIN_DISCOVER_CACHE"])
    discover.run(env, discover.Clock(2.0, 2.0, "b"))
    assert stamp(cache) == {"wall": 2.0, "monotonic": 2.0, "boot_id": "b"}
    fake_etcd(monkeypatch, [(PREFIX + "a", value(1)), (PREFIX + "b", value(1))])
    discover.run(env, discover.Clock(3.0, 3.0, "b"))
    data = json.loads(cache.read_text())
    assert (data["job"], data["hosts"]) == ("job1", ["a:1", "b:1"])
    assert [p.name for p in cache.parent.iterdir()] == [cache.name], "no temp file left behind"


@pytest.mark.parametrize(
    "line",
    [
        "x;touch /tmp/PWNED;:1",
        "$(reboot):1",
        "a b:1",
        "-oProxyCommand=x:1",
        "h:0",
        "h:99999999",
        "h:1 ",
        "h",
        7,
        None,
        "h:\u0661",
    ],
)
def test_a_cached_line_that_etcd_would_refuse_is_never_printed(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], line: object
) -> None:
    fake_etcd(monkeypatch, [(PREFIX + "good", value(1))])
    clock = discover.Clock(1000.0, 50.0, "boot-1")
    discover.run(env, clock)
    cache = Path(env["ELASTICTRAIN_DISCOVER_CACHE"])
    data = json.loads(cache.read_text())
    data["hosts"].append(line)
    cache.write_text(json.dumps(data))
    fake_etcd(monkeypatch, None)
    code, out, err = discover.run(env, clock)
    assert (code, out) == (0, ["good:1"])
    assert err[0].startswith("discover: warning: skipping invalid cached host line") and len(err) == 2
    assert all(line.isprintable() for line in err)


def test_a_cache_without_a_stamp_is_not_served(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    cache = Path(env["ELASTICTRAIN_DISCOVER_CACHE"])
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"job": "job1", "hosts": ["a:1"]}))
    fake_etcd(monkeypatch, None)
    code, out, err = discover.run(env)
    assert (code, out) == (1, []) and "of unknown age" in err[0]


def test_a_bad_key_warning_escapes_its_newline_and_terminal_escapes(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    fake_etcd(monkeypatch, [(PREFIX + "ok", value(1)),
                            (PREFIX + "x\ndiscover: warning: all good\x1b[2J", value(1))])  # fmt: skip
    code, out, err = discover.run(env)
    assert (code, out) == (0, ["ok:1"])
    assert len(err) == 1 and err[0].isprintable() and "\\n" in err[0] and "\\x1b" in err[0]


def test_hosts_differing_only_in_case_are_listed_once(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    fake_etcd(monkeypatch, [(PREFIX + "node1", value(1)), (PREFIX + "Node1", value(2)), (PREFIX + "node2", value(1))])
    code, out, err = discover.run(env)
    assert (code, out) == (0, ["Node1:2", "node2:1"])
    assert err == ["discover: warning: skipping host 'node1': differs from 'Node1' only in case (one machine)"]


@pytest.mark.parametrize("job", ["..", "-x", "caf\u00e9", "a/b", "a\nb"])
def test_a_job_name_outside_the_one_rule_exits_2(env: dict[str, str], job: str) -> None:
    code, out, err = discover.run({**env, "ELASTICTRAIN_JOB": job})
    assert (code, out) == (2, []) and len(err) == 1 and "invalid job name" in err[0] and err[0].isprintable()


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


def test_hosts_table_shows_an_evictions_reason_and_the_time_to_readmission() -> None:
    base = dict(slots=1, addr="10.0.0.1", pid=9, registered_at=1000.0)
    evicted = HostRecord(
        host="node-a", state=DRAINING, drain_reason="straggler", drain_until=1300.0, evictions=1, **base
    )
    due = HostRecord(host="node-b", state=DRAINING, drain_reason="hung", drain_until=1000.0, evictions=3, **base)
    readmitted = HostRecord(host="node-c", evictions=2, **base)
    lines = format_table(Listing([Entry(r, 5, 1) for r in (evicted, due, readmitted)]), now=1200.0)
    assert lines[0].index("AGE") == lines[1].index("3m") == lines[3].index("3m"), "columns stay aligned"
    assert "draining (straggler, readmit in 100s, evictions 1)  3m" in lines[1]
    assert "draining (hung, readmit due, evictions 3)" in lines[2]
    assert lines[3].split()[:4] == ["node-c", "1", "ready", "3m"], "a ready host shows its state alone"


def test_discover_skips_a_host_whose_eviction_fields_are_malformed(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    evicted = b'{"slots": 1, "state": "draining", "drain_reason": "hung", "drain_until": 1.7e9, "evictions": 1}'
    readmitted = b'{"slots": 2, "state": "ready", "drain_reason": "", "drain_until": 0, "evictions": 4}'
    fake_etcd(monkeypatch, [(PREFIX + "a", evicted), (PREFIX + "b", readmitted),
                            (PREFIX + "c", b'{"slots": 1, "drain_until": NaN}')])  # fmt: skip
    code, out, err = discover.run(env)
    assert (code, out) == (0, ["b:2"])
    assert len(err) == 1 and "'c'" in err[0] and "drain_until must be a finite Unix time" in err[0]
