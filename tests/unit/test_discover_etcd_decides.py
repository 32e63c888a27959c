"""While etcd answers, discover.py lists what etcd's values say now: every value is parsed and checked at every call,
and nothing in the cache file (which whoever can write the run_dir could have written) supplies a host, its slots or
its state. etcd replies are faked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from discovery import discover

PREFIX = "/elastictrain/job1/hosts/"


def value(slots: int = 1, state: str = "ready", pid: int = 1) -> bytes:
    return json.dumps({"slots": slots, "addr": "10.0.0.1", "state": state, "pid": pid, "registered_at": 0}).encode()


EVICTED = b'{"slots": 2, "addr": "10.0.0.2", "state": "draining", "drain_reason": "straggler", "drain_until": 1.7e9}'


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {
        "ELASTICTRAIN_ETCD": "http://127.0.0.1:2379",
        "ELASTICTRAIN_JOB": "job1",
        "ELASTICTRAIN_DISCOVER_CACHE": str(tmp_path / "discover-job1.json"),
    }


class Etcd:
    """A fake etcd reply and a count of the values discover.py parsed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pairs: dict[str, bytes]) -> None:
        self.pairs = pairs
        self.parsed: list[str] = []
        real = discover.parse_value

        def parse_value(host: str, raw: bytes | str) -> dict[str, Any]:
            self.parsed.append(host)
            return real(host, raw)

        monkeypatch.setattr(discover, "parse_value", parse_value)
        monkeypatch.setattr(discover, "range_prefix", lambda *a: [(PREFIX + h, v) for h, v in self.pairs.items()])

    def call(self, env: dict[str, str]) -> tuple[int, list[str], list[str], list[str]]:
        self.parsed = []
        code, out, err = discover.run(env)
        return code, out, err, sorted(self.parsed)


def forge(env: dict[str, str], **fields: object) -> None:
    """Rewrite the cache file's fields, as whoever can write the run_dir could."""
    cache = Path(env["ELASTICTRAIN_DISCOVER_CACHE"])
    cache.write_text(json.dumps({**json.loads(cache.read_text()), **fields}))


def test_every_call_parses_every_value_so_a_change_in_etcd_shows_at_the_next_call(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    etcd = Etcd(monkeypatch, {"a": value(1), "b": value(2), "c": value(4, "draining")})
    assert etcd.call(env) == (0, ["a:1", "b:2"], [], ["a", "b", "c"])
    assert etcd.call(env) == (0, ["a:1", "b:2"], [], ["a", "b", "c"])

    etcd.pairs["b"] = value(2, "draining")  # drained: its value changed
    etcd.pairs["c"] = value(4, "ready", pid=2)  # re-registered by a new agent
    etcd.pairs["d"] = value(8)  # joined
    del etcd.pairs["a"]  # left
    assert etcd.call(env) == (0, ["c:4", "d:8"], [], ["b", "c", "d"])
    data = json.loads(Path(env["ELASTICTRAIN_DISCOVER_CACHE"]).read_text())
    assert sorted(data) == ["hosts", "job", "read_at"], "the cache keeps the answer and its stamp, no parsed values"
    assert data["hosts"] == ["c:4", "d:8"]


def test_malformed_values_are_reported_at_every_call(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    etcd = Etcd(monkeypatch, {"good": value(1), "bad": b"{not json", "zero": value(0)})
    for _ in range(2):
        code, out, err, parsed = etcd.call(env)
        assert (code, out, parsed) == (0, ["good:1"], ["bad", "good", "zero"])
        assert len(err) == 2 and all(line.startswith("discover: warning: skipping malformed value") for line in err)


@pytest.mark.parametrize(
    ("host", "forged"),
    [
        ("drained", [4, "ready"]),  # a drained host re-admitted
        ("evicted", [2, "ready"]),  # an evicted host re-admitted before its agent readmits it
        ("ready", [64, "ready"]),  # a ready host's slots changed
    ],
)
def test_a_forged_cache_entry_never_overrides_what_etcd_says_now(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], host: str, forged: list[Any]
) -> None:
    etcd = Etcd(monkeypatch, {"drained": value(4, "draining"), "evicted": EVICTED, "ready": value(2)})
    assert etcd.call(env)[:2] == (0, ["ready:2"])
    # Whoever can write the cache file knows etcd's value (etcd is readable, or an older cache kept it): the entry
    # matches the value byte for byte, and only the slots or the state it claims are false.
    forge(env, parsed={host: [etcd.pairs[host].decode("latin-1"), *forged]}, hosts=[f"{host}:{forged[0]}"])
    code, out, err, _ = etcd.call(env)
    assert (code, out, err) == (0, ["ready:2"], [])


def test_a_host_name_etcd_should_never_hold_is_refused_whatever_the_cache_says(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    etcd = Etcd(monkeypatch, {"ok": value(1)})
    etcd.call(env)
    forge(env, parsed={"-x;reboot": [value(1).decode("latin-1"), 1, "ready"]})
    etcd.pairs["-x;reboot"] = value(1)
    code, out, err, parsed = etcd.call(env)
    assert (code, out, parsed) == (0, ["ok:1"], ["-x;reboot", "ok"])
    assert len(err) == 1 and "invalid host name" in err[0]
