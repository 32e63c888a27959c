"""The preemption notice over real HTTP: each cloud's watch against a local metadata service on loopback, hostile
answers that change nothing, and a real agent process against a real etcd that drains its host on a notice."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from discovery.notice import NoticeError
from discovery.noticewatch import NoticeWatch, build, http_request, probe
from discovery.registry import EtcdRegistry
from tests.fixtures.etcd import EtcdServer
from tests.fixtures.metadata_server import MODES, MetadataServer
from tests.fixtures.procs import VENV_BIN, ProcessGroup, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

POLL = 0.3
"""The watches' poll interval in these tests (seconds)."""
WHEN = "2026-12-06T06:20:00Z"
WHEN_UNIX = 1796538000.0
ENV = {"aws": "ELASTICTRAIN_AWS_METADATA", "gcp": "ELASTICTRAIN_GCP_METADATA", "azure": "ELASTICTRAIN_AZURE_METADATA"}


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, msg: str, **kw: Any) -> None:
        self.lines.append((msg, kw))

    info = warning

    def errors(self) -> list[str]:
        return [kw["error"] for msg, kw in self.lines if "error" in kw]


def watch(md: MetadataServer, cloud: str, log: Log) -> NoticeWatch:
    w = build(cloud, env={ENV[cloud]: md.url}, timeout_seconds=1.0, poll_seconds=POLL, log=log)
    assert w is not None
    for source in w.sources:
        if hasattr(source, "wait_seconds"):
            source.wait_seconds = 2  # GCP's hanging GETs: short, so a test's server can close
    w.error_gap_seconds = POLL
    return w.start()


def give_notice(md: MetadataServer, cloud: str) -> None:
    if cloud == "aws":
        md.set(aws_action={"action": "terminate", "time": WHEN})
    elif cloud == "gcp":
        md.set(gcp_preempted="TRUE")
    else:
        md.set(azure_events=[{
            "EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123", "EventStatus": "Scheduled", "EventType": "Preempt",
            "ResourceType": "VirtualMachine", "Resources": ["vm-1"], "NotBefore": "Sun, 06 Dec 2026 06:20:00 GMT",
            "Description": "", "EventSource": "Platform", "DurationInSecs": -1,
        }])  # fmt: skip


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_each_clouds_watch_reads_its_notice_within_a_poll_period(cloud: str) -> None:
    log = Log()
    with MetadataServer() as md:
        w = watch(md, cloud, log)
        try:
            wait_until(lambda: len(md.requests) >= 3, 10, what="the watch polls")
            assert w.notice() is None and log.errors() == []
            given = time.monotonic()
            give_notice(md, cloud)
            wait_until(lambda: w.notice() is not None, POLL + 2.0, what=f"{cloud} notice read")
            took = time.monotonic() - given
        finally:
            w.stop()
    notice = w.notice()
    assert notice is not None and notice.cloud == cloud
    if cloud != "gcp":
        assert notice.time == WHEN_UNIX, "the time the cloud gives"
    else:
        assert notice.time == pytest.approx(time.time() + 30, abs=5), "GCP's documented 30 s"
    assert took <= POLL + 1.0
    if cloud == "gcp":
        assert any("wait_for_change" not in r for r in md.requests)
        assert md.count("GET /computeMetadata/v1/instance/preempted") <= 4, "waits for a change instead of polling"


@pytest.mark.parametrize("mode", MODES)
def test_a_hostile_answer_changes_nothing_is_logged_in_one_line_and_the_watch_polls_on(mode: str) -> None:
    cloud = "gcp" if mode == "no-flavor" else "aws"
    log = Log()
    with MetadataServer() as md:
        give_notice(md, cloud)
        md.set(mode=mode)
        w = watch(md, cloud, log)
        try:
            wait_until(lambda: log.errors(), 5, what="a warning")
            seen = len(md.requests)
            wait_until(lambda: len(md.requests) > seen, 5, what="the watch polls on")
            assert w.notice() is None, f"a {mode} answer is no notice"
            md.set(mode=None)
            wait_until(lambda: w.notice() is not None, 5, what="the notice read once the service answers well")
        finally:
            w.stop()
    (error, *_) = log.errors()
    assert "\n" not in error and len(error) < 200, error


@pytest.mark.parametrize("mode", ["huge", "silent", "drip"])
def test_every_read_is_bounded_in_size_and_time(mode: str) -> None:
    with MetadataServer() as md:
        md.set(mode=mode)
        start = time.monotonic()
        with pytest.raises(NoticeError) as e:
            http_request("GET", f"{md.url}/latest/meta-data/spot/instance-action", {}, 1.0)
        took = time.monotonic() - start
    assert took < 3.0, "the deadline (1 s) bounds the whole exchange; the rest is this machine's load"
    assert ("larger than 64 KiB" if mode == "huge" else "no complete answer within 1s") in str(e.value)


def test_auto_probes_and_keeps_the_cloud_that_answers() -> None:
    nothing = "http://127.0.0.1:9"  # the discard port: nothing listens on loopback
    with MetadataServer() as md:
        for cloud in ("aws", "gcp", "azure"):
            env = {**dict.fromkeys(ENV.values(), nothing), ENV[cloud]: md.url}
            assert probe(env, timeout_seconds=1.0) == cloud
    assert probe(dict.fromkeys(ENV.values(), nothing), timeout_seconds=0.5) is None


# -- a real agent against a real etcd --------------------------------------------------------------------

JOB = "notice"


def start_agent(procs: ProcessGroup, etcd: EtcdServer, md: MetadataServer, cloud: str, log: Path) -> None:
    args = [str(VENV_BIN / "elastictrain"), "agent", "--etcd", etcd.endpoint, "--job", JOB, "--host", "node-a",
            "--slots", "1", "--ttl", "3", "--heartbeat", "1", "--request-timeout", "0.5",
            "--preemption-notice", cloud, "--notice-poll", str(POLL)]  # fmt: skip
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", ENV[cloud]: md.url,
           "ELASTICTRAIN_LOG_FORMAT": "json"}  # fmt: skip
    with log.open("ab") as f:
        procs.start(args, stdout=subprocess.DEVNULL, stderr=f, env=env)


def host(etcd: EtcdServer) -> dict[str, Any] | None:
    with EtcdRegistry(etcd.endpoint, JOB, timeout_seconds=1.0) as registry:
        entry = registry.get("node-a")
    if entry is None:
        return None
    r = entry.record
    return {"state": r.state, "notice": r.notice, "notice_time": r.notice_time}


def logged(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def test_a_notice_drains_the_agents_host_in_etcd_within_a_poll_period(
    etcd_server: EtcdServer, procs: ProcessGroup, tmp_path: Path
) -> None:
    log = tmp_path / "agent.log"
    with MetadataServer() as md:
        start_agent(procs, etcd_server, md, "aws", log)
        wait_until(lambda: (host(etcd_server) or {}).get("state") == "ready", 15, what="node-a registered")
        wait_until(lambda: md.count("GET /latest/meta-data/spot/instance-action") >= 2, 10, what="the agent polls")
        given = time.monotonic()
        give_notice(md, "aws")
        wait_until(lambda: (host(etcd_server) or {}).get("state") == "draining", POLL + 1.5,
                   what="node-a draining within a poll period")  # fmt: skip
        took = time.monotonic() - given
        assert host(etcd_server) == {"state": "draining", "notice": "aws-spot-terminate", "notice_time": WHEN_UNIX}
    events = [e.get("event", "") for e in logged(log)]
    assert f"preemption notice aws-spot-terminate: the instance ends at {WHEN}" in events
    assert any(e.endswith("marking host draining with the notice") for e in events)
    print(f"notice -> draining in etcd: {took:.2f}s (poll {POLL}s)")


def test_a_hostile_metadata_service_leaves_the_agents_host_ready(
    etcd_server: EtcdServer, procs: ProcessGroup, tmp_path: Path
) -> None:
    log = tmp_path / "agent.log"
    with MetadataServer() as md:
        md.set(gcp_preempted="TRUE", mode="no-flavor")
        start_agent(procs, etcd_server, md, "gcp", log)
        wait_until(lambda: (host(etcd_server) or {}).get("state") == "ready", 15, what="node-a registered")
        wait_until(lambda: any("Metadata-Flavor" in str(e.get("error")) for e in logged(log)), 10,
                   what="the refused answer logged")  # fmt: skip
        polled = md.count("GET /computeMetadata/v1/instance/preempted")
        wait_until(lambda: md.count("GET /computeMetadata/v1/instance/preempted") >= polled + 2, 10,
                   what="the agent polls on")  # fmt: skip
        assert host(etcd_server) == {"state": "ready", "notice": "", "notice_time": 0.0}
        warnings = [e for e in logged(log) if "Metadata-Flavor" in str(e.get("error"))]
        assert sorted(e["source"] for e in warnings) == ["gcp maintenance-event", "gcp preempted"], (
            "one line per source and new error, not one per poll"
        )
        md.set(mode=None)
        wait_until(lambda: (host(etcd_server) or {}).get("notice") == "gcp-preempted", 10, what="then the notice")


def test_auto_off_cloud_watches_nothing_and_says_so(
    etcd_server: EtcdServer, procs: ProcessGroup, tmp_path: Path
) -> None:
    log = tmp_path / "agent.log"
    args = [str(VENV_BIN / "elastictrain"), "agent", "--etcd", etcd_server.endpoint, "--job", JOB, "--host",
            "node-a", "--slots", "1", "--ttl", "3", "--heartbeat", "1", "--request-timeout", "0.5",
            "--preemption-notice", "auto"]  # fmt: skip
    nothing = "http://127.0.0.1:9"
    env = {**os.environ, **dict.fromkeys(ENV.values(), nothing), "ELASTICTRAIN_LOG_FORMAT": "json"}
    with log.open("ab") as f:
        procs.start(args, stdout=subprocess.DEVNULL, stderr=f, env=env)
    wait_until(lambda: (host(etcd_server) or {}).get("state") == "ready", 15, what="node-a registered")
    events = [e.get("event", "") for e in logged(log)]
    assert "--preemption-notice auto: no metadata service answered; not watching for preemption notices" in events
    starting = next(e for e in logged(log) if e.get("event") == "agent starting")
    assert starting["preemption_notice"] == "none"
