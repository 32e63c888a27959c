"""discover.py parses a host's value only when it changed since the previous call (the values parsed are kept in
the cache file), so a call's per-host cost at 1,000 hosts is a string comparison. etcd replies are faked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from discovery import discover

PREFIX = "/elastictrain/job1/hosts/"


def value(slots: int = 1, state: str = "ready", pid: int = 1) -> bytes:
    return json.dumps({"slots": slots, "addr": "10.0.0.1", "state": state, "pid": pid, "registered_at": 0}).encode()


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


def test_a_value_unchanged_since_the_last_call_is_not_parsed_again(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    etcd = Etcd(monkeypatch, {"a": value(1), "b": value(2), "c": value(4, "draining")})
    assert etcd.call(env) == (0, ["a:1", "b:2"], [], ["a", "b", "c"])
    assert etcd.call(env) == (0, ["a:1", "b:2"], [], [])

    etcd.pairs["b"] = value(2, "draining")  # drained: its value changed
    etcd.pairs["c"] = value(4, "ready", pid=2)  # re-registered by a new agent
    etcd.pairs["d"] = value(8)  # joined
    del etcd.pairs["a"]  # left
    assert etcd.call(env) == (0, ["c:4", "d:8"], [], ["b", "c", "d"])
    assert etcd.call(env) == (0, ["c:4", "d:8"], [], [])
    kept = json.loads(Path(env["ELASTICTRAIN_DISCOVER_CACHE"]).read_text())["parsed"]
    assert sorted(kept) == ["b", "c", "d"]  # hosts that left are forgotten


def test_malformed_values_are_reported_at_every_call(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    etcd = Etcd(monkeypatch, {"good": value(1), "bad": b"{not json", "zero": value(0)})
    for first in (True, False):
        code, out, err, parsed = etcd.call(env)
        assert (code, out, parsed) == (0, ["good:1"], ["bad", "good", "zero"] if first else ["bad", "zero"])
        assert len(err) == 2 and all(line.startswith("discover: warning: skipping malformed value") for line in err)


@pytest.mark.parametrize(
    "entry",
    [
        "not a list",
        ["x", 1],
        ["<the value>", 0, "ready"],  # slots out of range
        ["<the value>", True, "ready"],
        ["<the value>", 1, "gone"],  # not a state
    ],
)
def test_a_bad_entry_in_the_cache_file_is_parsed_again_never_printed(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], entry: object
) -> None:
    etcd = Etcd(monkeypatch, {"a": value(2)})
    etcd.call(env)
    cache = Path(env["ELASTICTRAIN_DISCOVER_CACHE"])
    data = json.loads(cache.read_text())
    text = value(2).decode("latin-1")
    data["parsed"]["a"] = [text if e == "<the value>" else e for e in entry] if isinstance(entry, list) else entry
    cache.write_text(json.dumps(data))
    assert etcd.call(env) == (0, ["a:2"], [], ["a"])


def test_a_host_name_etcd_should_never_hold_is_checked_even_when_its_value_is_known(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    etcd = Etcd(monkeypatch, {"ok": value(1)})
    etcd.call(env)
    cache = Path(env["ELASTICTRAIN_DISCOVER_CACHE"])
    data = json.loads(cache.read_text())
    data["parsed"]["-x;reboot"] = data["parsed"]["ok"]
    cache.write_text(json.dumps(data))
    etcd.pairs["-x;reboot"] = value(1)
    code, out, err, parsed = etcd.call(env)
    assert (code, out, parsed) == (0, ["ok:1"], ["-x;reboot"])
    assert len(err) == 1 and "invalid host name" in err[0]


def test_another_jobs_cache_is_not_used(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    etcd = Etcd(monkeypatch, {"a": value(1)})
    etcd.call(env)
    cache = Path(env["ELASTICTRAIN_DISCOVER_CACHE"])
    data = json.loads(cache.read_text())
    cache.write_text(json.dumps({**data, "job": "other"}))
    assert etcd.call(env)[3] == ["a"]
