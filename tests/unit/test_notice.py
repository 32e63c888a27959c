"""The cloud's preemption notice drains the host: the parsers, each cloud's protocol over a fake request, the watch,
the agent's decision and the agent on an in-memory store."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from discovery.agent import Action, Agent, AgentState, Observation, decide, main
from discovery.notice import (
    CheckpointPlan,
    Notice,
    NoticeError,
    parse_aws_instance_action,
    parse_aws_rebalance,
    parse_azure_events,
    parse_gcp_maintenance,
    parse_gcp_preempted,
    plan_checkpoint,
)
from discovery.noticewatch import Answer, AwsSource, AzureSource, GcpSource, NoticeWatch, build, endpoint, probe
from discovery.record import DRAINING, READY, HostRecord, MalformedRecord
from discovery.registry import InMemoryRegistry, evict, set_state
from tests.fixtures.agent import agent_config as cfg
from tests.fixtures.clock import FakeClock

T0 = 1796538000.0
"""2026-12-06T06:20:00Z."""
T0_ISO = "2026-12-06T06:20:00Z"
T0_RFC1123 = "Sun, 06 Dec 2026 06:20:00 GMT"

# -- parsers ------------------------------------------------------------------------------------------


def test_an_aws_spot_interruption_gives_the_action_and_the_time() -> None:
    body = json.dumps({"action": "terminate", "time": T0_ISO}).encode()
    assert parse_aws_instance_action(body) == Notice("aws", "spot-terminate", T0)
    stop = parse_aws_instance_action(b'{"action": "stop", "time": "2026-12-06T06:20:00.123Z"}')
    assert (stop.token, stop.time) == ("aws-spot-stop", T0)
    assert parse_aws_rebalance(json.dumps({"noticeTime": T0_ISO}).encode()) == T0


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"<html>not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"action": "reboot", "time": "2026-12-06T06:20:00Z"}', "action must be one of"),
        (b'{"action": "terminate"}', "expected a UTC time"),
        (b'{"action": "terminate", "time": "tomorrow"}', "expected a UTC time"),
        (b'{"action": "terminate", "time": "2026-12-06T06:20:00+02:00"}', "expected a UTC time"),
        (b'{"action": "terminate", "time": 1796533200}', "expected a UTC time"),
        (b'{"action": "terminate", "time": "9999999-12-06T06:20:00Z"}', "expected a UTC time"),
    ],
)
def test_a_bad_aws_answer_is_a_one_line_error(body: bytes, match: str) -> None:
    with pytest.raises(NoticeError, match=match) as e:
        parse_aws_instance_action(body)
    assert "\n" not in str(e.value)


def test_gcp_preempted_and_a_terminating_maintenance_are_notices_with_the_documented_warning() -> None:
    assert parse_gcp_preempted(b"FALSE", T0) is None
    assert parse_gcp_preempted(b"TRUE", T0) == Notice("gcp", "preempted", T0 + 30)
    assert parse_gcp_maintenance(b"NONE", T0) is None
    assert parse_gcp_maintenance(b"MIGRATE_ON_HOST_MAINTENANCE", T0) is None, "a live migration keeps the VM"
    assert parse_gcp_maintenance(b"TERMINATE_ON_HOST_MAINTENANCE", T0) == Notice("gcp", "maintenance", T0 + 60)
    for bad in (b"yes", b"\x1b[31mTRUE", b"T" * 100, b"\xff"):
        with pytest.raises(NoticeError):
            parse_gcp_preempted(bad, T0)


def azure_events(*events: dict[str, Any]) -> bytes:
    return json.dumps({"DocumentIncarnation": 3, "Events": list(events)}).encode()


def azure_event(event_type: str = "Preempt", resources: tuple[str, ...] = ("vm-1",), **kw: Any) -> dict[str, Any]:
    return {
        "EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventStatus": "Scheduled", "EventType": event_type,
        "ResourceType": "VirtualMachine", "Resources": list(resources), "NotBefore": T0_RFC1123,
        "Description": "", "EventSource": "Platform", "DurationInSecs": -1, **kw,
    }  # fmt: skip


def test_an_azure_preempt_or_terminate_naming_this_vm_is_a_notice() -> None:
    assert parse_azure_events(azure_events(), "vm-1", T0 - 60) is None
    assert parse_azure_events(azure_events(azure_event()), "vm-1", T0 - 60) == Notice("azure", "preempt", T0)
    assert parse_azure_events(azure_events(azure_event("Preempt", ("vm-2",))), "vm-1", T0) is None, "another VM"
    assert parse_azure_events(azure_events(azure_event("Reboot")), "vm-1", T0) is None, "the VM comes back"
    later = azure_event("Terminate", NotBefore="Sun, 06 Dec 2026 06:25:00 GMT")
    started = azure_event("Terminate", NotBefore="", EventStatus="Started")
    assert parse_azure_events(azure_events(later, azure_event()), "vm-1", T0) == Notice("azure", "preempt", T0)
    assert parse_azure_events(azure_events(started), "vm-1", T0 - 5) == Notice("azure", "terminate", T0 - 5)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b'{"Events": {}}', "Events is not a list"),
        (b'{"Events": [1]}', "an event is not an object"),
        (json.dumps({"Events": [{**azure_event(), "Resources": "vm-1"}]}).encode(), "Resources is not a list"),
        (json.dumps({"Events": [azure_event(NotBefore="soon")]}).encode(), "expected an RFC 1123 time"),
        (json.dumps({"Events": [azure_event()] * 101}).encode(), "more than 100"),
        (b"[" * 65536, "not JSON"),  # nesting deeper than Python's stack (a RecursionError, caught)
    ],
)
def test_a_bad_azure_answer_is_a_one_line_error(body: bytes, match: str) -> None:
    with pytest.raises(NoticeError, match=match):
        parse_azure_events(body, "vm-1", T0)


# -- each cloud's protocol over a fake request ------------------------------------------------------------


Handler = Callable[[str, str, Mapping[str, str]], Answer]


class FakeRequest:
    """Records what a source sends; ``handler`` answers."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.sent: list[tuple[str, str, dict[str, str], float]] = []

    def __call__(self, method: str, url: str, headers: Mapping[str, str], timeout: float) -> Answer:
        self.sent.append((method, url, dict(headers), timeout))
        return self.handler(method, url, headers)


def ok(body: bytes | str, **headers: str) -> Answer:
    return Answer(200, {k.lower().replace("_", "-"): v for k, v in headers.items()}, bytes(body, "ascii") if
                  isinstance(body, str) else body)  # fmt: skip


NOT_FOUND = Answer(404, {}, b"")


def test_aws_takes_a_session_token_first_and_sends_it_with_every_read() -> None:
    notice: dict[str, Any] = {}

    def imds(method: str, url: str, headers: Mapping[str, str]) -> Answer:
        if url.endswith("/latest/api/token"):
            assert method == "PUT" and headers["X-aws-ec2-metadata-token-ttl-seconds"] == "21600"
            return ok("tok-1")
        assert headers["X-aws-ec2-metadata-token"] == "tok-1"
        if url.endswith("/spot/instance-action") and notice:
            return ok(json.dumps(notice))
        return NOT_FOUND

    req = FakeRequest(imds)
    src = AwsSource("http://imds", request=req, clock=FakeClock())
    assert src.poll() is None and src.poll() is None
    assert [(m, u) for m, u, _, _ in req.sent] == [
        ("PUT", "http://imds/latest/api/token"),
        ("GET", "http://imds/latest/meta-data/spot/instance-action"),
        ("GET", "http://imds/latest/meta-data/events/recommendations/rebalance"),
        ("GET", "http://imds/latest/meta-data/spot/instance-action"),
        ("GET", "http://imds/latest/meta-data/events/recommendations/rebalance"),
    ], "one token for many reads"
    notice.update(action="terminate", time=T0_ISO)
    assert src.poll() == Notice("aws", "spot-terminate", T0)
    assert req.sent[-1][1].endswith("/spot/instance-action"), "a notice is returned before the rebalance is read"


def test_aws_takes_a_new_token_after_a_401_and_at_half_its_life() -> None:
    tokens = iter(["tok-1", "tok-2", "tok-3"])
    valid = {"tok-1"}

    def imds(method: str, url: str, headers: Mapping[str, str]) -> Answer:
        if method == "PUT":
            return ok(next(tokens))
        return NOT_FOUND if headers["X-aws-ec2-metadata-token"] in valid else Answer(401, {}, b"")

    clock = FakeClock()
    src = AwsSource("http://imds", request=FakeRequest(imds), clock=clock)
    assert src.poll() is None
    valid.clear()
    with pytest.raises(NoticeError, match="HTTP 401"):
        src.poll()
    valid.add("tok-2")
    assert src.poll() is None and src.token == "tok-2"
    clock.advance(21600 / 2)
    valid.add("tok-3")
    assert src.poll() is None and src.token == "tok-3"


def test_an_aws_rebalance_recommendation_is_logged_once_and_drains_nothing() -> None:
    log = RecordingLog()

    def imds(method: str, url: str, headers: Mapping[str, str]) -> Answer:
        if method == "PUT":
            return ok("tok")
        return ok(json.dumps({"noticeTime": T0_ISO})) if url.endswith("/rebalance") else NOT_FOUND

    src = AwsSource("http://imds", request=FakeRequest(imds), clock=FakeClock(), log=log)
    assert src.poll() is None and src.poll() is None
    assert [m for m, _ in log.warnings] == [
        "aws rebalance recommendation: this spot instance is at elevated risk of interruption "
        "(not drained: no interruption notice yet)"
    ]


def test_gcp_reads_the_value_first_then_waits_for_a_change_with_the_etag() -> None:
    values = iter([("FALSE", "e1"), ("FALSE", "e1"), ("TRUE", "e2")])

    def server(method: str, url: str, headers: Mapping[str, str]) -> Answer:
        assert headers["Metadata-Flavor"] == "Google"
        value, etag = next(values)
        return ok(value, Metadata_Flavor="Google", ETag=etag)

    req = FakeRequest(server)
    src = GcpSource("http://md", "preempted", parse_gcp_preempted, request=req, wait_seconds=30,
                    timeout_seconds=2.0, wall_clock=lambda: T0)  # fmt: skip
    assert src.poll() is None and src.poll() is None
    assert src.poll() == Notice("gcp", "preempted", T0 + 30)
    assert [(u, t) for _, u, _, t in req.sent] == [
        ("http://md/computeMetadata/v1/instance/preempted", 2.0),
        ("http://md/computeMetadata/v1/instance/preempted?wait_for_change=true&timeout_sec=30&last_etag=e1", 32.0),
        ("http://md/computeMetadata/v1/instance/preempted?wait_for_change=true&timeout_sec=30&last_etag=e1", 32.0),
    ]


def test_a_gcp_answer_without_the_metadata_flavor_header_is_refused() -> None:
    src = GcpSource("http://md", "preempted", parse_gcp_preempted, request=FakeRequest(lambda *a: ok("TRUE")))
    with pytest.raises(NoticeError, match="no 'Metadata-Flavor: Google' header"):
        src.poll()


def test_azure_learns_the_vm_name_once_and_reads_scheduled_events_with_the_metadata_header() -> None:
    events: list[dict[str, Any]] = []

    def imds(method: str, url: str, headers: Mapping[str, str]) -> Answer:
        assert headers == {"Metadata": "true"}
        if "/compute/name" in url:
            return ok("vm-1")
        assert url == "http://imds/metadata/scheduledevents?api-version=2020-07-01"
        return ok(azure_events(*events))

    req = FakeRequest(imds)
    src = AzureSource("http://imds", request=req, wall_clock=lambda: T0 - 30)
    assert src.poll() is None
    events.append(azure_event())
    assert src.poll() == Notice("azure", "preempt", T0)
    assert sum("/compute/name" in u for _, u, _, _ in req.sent) == 1
    assert all(m == "GET" for m, _, _, _ in req.sent), "no acknowledgement: it would end the VM sooner"


# -- the watch --------------------------------------------------------------------------------------------


class RecordingLog:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []
        self.infos: list[str] = []

    def warning(self, msg: str, **kw: Any) -> None:
        self.warnings.append((msg, kw))

    def info(self, msg: str, **kw: Any) -> None:
        self.infos.append(msg)


class ScriptedSource(AwsSource):
    def __init__(self, *answers: Notice | Exception | None) -> None:
        super().__init__("http://unused")
        self.answers = list(answers)

    def poll(self) -> Notice | None:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_an_event_type_that_is_not_a_string_is_no_notice() -> None:
    assert parse_azure_events(azure_events(azure_event(EventType=[1])), "vm-1", T0) is None


def test_a_surprise_in_a_poll_is_a_failed_poll_and_the_watch_goes_on() -> None:
    notice = Notice("aws", "spot-terminate", T0)
    src = ScriptedSource(TypeError("unhashable type: 'list'"), notice)
    log = RecordingLog()
    watch = NoticeWatch("aws", [src], log=log)
    assert watch.poll_once(src) is False and watch.notice() is None
    assert "TypeError" in log.warnings[0][1]["error"]
    assert watch.poll_once(src) is True and watch.notice() == notice


def test_a_bad_answer_changes_nothing_is_logged_once_and_the_first_notice_is_kept() -> None:
    notice, later = Notice("aws", "spot-terminate", T0), Notice("aws", "spot-stop", T0 + 5)
    src = ScriptedSource(NoticeError("HTTP 500"), NoticeError("HTTP 500"), None, notice, later, NoticeError("x"))
    log = RecordingLog()
    watch = NoticeWatch("aws", [src], log=log)
    assert [watch.poll_once(src) for _ in range(3)] == [False, False, True]
    assert watch.notice() is None
    assert [kw["error"] for _, kw in log.warnings] == ["HTTP 500"], "one line per new error"
    assert log.infos == ["preemption notice readable again"]
    watch.poll_once(src)
    watch.poll_once(src)
    assert not watch.poll_once(src)
    assert watch.notice() == notice, "the first notice holds"
    assert [m for m, _ in log.warnings[1:2]] == [f"preemption notice aws-spot-terminate: the instance ends at {T0_ISO}"]


# -- choosing the cloud -------------------------------------------------------------------------------------


def test_endpoints_come_from_the_environment_and_must_be_plain_http() -> None:
    assert endpoint("aws", {}) == "http://169.254.169.254"
    assert endpoint("gcp", {}) == "http://metadata.google.internal"
    assert endpoint("gcp", {"ELASTICTRAIN_GCP_METADATA": "http://127.0.0.1:8080/"}) == "http://127.0.0.1:8080"
    for bad in ("https://x", "http://x/latest", "169.254.169.254", "http://x:port", "http://x?q=1"):
        with pytest.raises(ValueError, match=r"ELASTICTRAIN_AZURE_METADATA=.*expected http://HOST"):
            endpoint("azure", {"ELASTICTRAIN_AZURE_METADATA": bad})


def test_auto_keeps_the_cloud_whose_service_answers_as_its_own() -> None:
    def only(cloud: str) -> Callable[[str, str, Mapping[str, str], float], Answer]:
        def request(method: str, url: str, headers: Mapping[str, str], timeout: float) -> Answer:
            if cloud == "aws" and method == "PUT":
                return ok("tok")
            if cloud == "gcp" and "computeMetadata" in url:
                return ok("123", Metadata_Flavor="Google")
            if cloud == "azure" and headers.get("Metadata") == "true":
                return ok("vm-1")
            raise NoticeError("connection refused")

        return request

    assert [probe({}, request=only(c)) for c in ("aws", "gcp", "azure")] == ["aws", "gcp", "azure"]
    assert probe({}, request=lambda *a: ok("123")) == "aws", "aws first: its PUT answered"

    def impostor(method: str, url: str, headers: Mapping[str, str], timeout: float) -> Answer:
        if method == "PUT" or "/compute/name" in url:
            raise NoticeError("refused")
        return ok("123")  # no Metadata-Flavor: not GCP's server

    assert probe({}, request=impostor) is None


def test_build_none_watches_nothing_and_a_cloud_gets_its_sources() -> None:
    assert build("none") is None
    watch = build("gcp", env={"ELASTICTRAIN_GCP_METADATA": "http://127.0.0.1:9"}, log=RecordingLog())
    assert watch is not None and watch.cloud == "gcp"
    assert [s.name for s in watch.sources] == ["gcp preempted", "gcp maintenance-event"]
    with pytest.raises(ValueError, match="--preemption-notice must be one of none, auto, aws, gcp, azure"):
        build("oracle")


@pytest.mark.parametrize(
    ("argv", "env", "match"),
    [
        (["--preemption-notice", "oracle"], {}, "invalid choice: 'oracle'"),
        (["--preemption-notice", "aws"], {"ELASTICTRAIN_AWS_METADATA": "https://x"}, "ELASTICTRAIN_AWS_METADATA="),
        (["--preemption-notice", "aws", "--notice-poll", "0"], {}, "--notice-poll must be in [0.1, 60]"),
    ],
)
def test_agent_cli_misuse_of_the_notice_flags_exits_2_with_one_line(
    argv: list[str], env: dict[str, str], match: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exc:
        main(["--etcd", "http://127.0.0.1:1", "--job", "j", "--host", "n", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and match in err


# -- the record -------------------------------------------------------------------------------------------


def test_the_record_keeps_the_notice_through_every_state_change_and_validates_it_on_read() -> None:
    rec = HostRecord(host="n", slots=1, addr="127.0.0.1").with_notice("aws-spot-terminate", T0)
    assert (rec.state, rec.notice, rec.notice_time) == (DRAINING, "aws-spot-terminate", T0)
    assert HostRecord.from_json("n", rec.to_json()) == rec
    assert rec.with_state(READY).notice == "aws-spot-terminate"
    old = HostRecord.from_json("n", b'{"slots": 1}')
    assert (old.notice, old.notice_time) == ("", 0.0), "values written before the notice existed still parse"
    for bad in (b'{"slots":1,"notice":"\\u001b[2J"}', b'{"slots":1,"notice":7}', b'{"slots":1,"notice_time":-1}',
                b'{"slots":1,"notice_time":"soon"}', b'{"slots":1,"notice":"' + b"a" * 33 + b'"}'):  # fmt: skip
        with pytest.raises(MalformedRecord, match="notice"):
            HostRecord.from_json("n", bad)


# -- decide() with a notice ---------------------------------------------------------------------------------

NOTICE = Notice("gcp", "preempted", T0)
SAYS = f"preemption notice gcp-preempted: the instance ends at {T0_ISO}"


def test_a_notice_drains_a_ready_host_at_once_and_keeps_the_lease() -> None:
    st = AgentState(lease_id=0x10, registered=True)
    d = decide(cfg(), st, Observation(now=5.0, lease_alive=True, key_state=READY, key_lease=0x10, notice=NOTICE))
    assert (d.action, d.reason, d.exit_code) == (Action.DRAIN_NOTICE, f"{SAYS}; marking host draining with the "
                                                 "notice", None)  # fmt: skip
    done = Observation(now=8.0, lease_alive=True, key_state=DRAINING, key_lease=0x10, notice=NOTICE,
                       key_notice="gcp-preempted", key_notice_time=T0)  # fmt: skip
    d = decide(cfg(), st, done)
    assert (d.action, d.reason) == (Action.HEARTBEAT, "lease 10 refreshed; host draining (gcp-preempted)")


def test_a_host_drained_otherwise_still_records_the_notice() -> None:
    st = AgentState(lease_id=0x10, registered=True, wanted_state=DRAINING)
    obs = Observation(now=5.0, lease_alive=True, key_state=DRAINING, key_lease=0x10, notice=NOTICE)
    assert decide(cfg(), st, obs).action is Action.DRAIN_NOTICE


def test_a_noticed_host_registers_as_draining() -> None:
    d = decide(cfg(), AgentState(), Observation(now=0.0, notice=NOTICE))
    assert (d.action, d.reason) == (
        Action.REGISTER, f"{SAYS}; registering node-a (2 slots) as draining under a new 9s lease")  # fmt: skip


# -- the agent on an in-memory store -----------------------------------------------------------------------


class FakeWatch:
    def __init__(self) -> None:
        self.value: Notice | None = None

    def notice(self) -> Notice | None:
        return self.value


def agent(**kw: object) -> tuple[Agent, InMemoryRegistry, FakeWatch, FakeClock]:
    clock = FakeClock(100.0)
    registry = InMemoryRegistry("job1", clock=clock)
    watch = FakeWatch()
    a = Agent(cfg(**kw), registry, clock=clock, wall_clock=lambda: T0 - 200 + clock.now, notice_watch=watch)
    a.log = RecordingLog()
    return a, registry, watch, clock


def record(registry: InMemoryRegistry) -> HostRecord:
    entry = registry.get("node-a")
    assert entry is not None
    return entry.record


def test_a_notice_ends_the_agents_wait_and_its_next_cycle_drains_the_host_with_the_notice() -> None:
    a, registry, watch, clock = agent()
    a.run_cycle()
    assert record(registry).state == READY
    woke: list[float] = []

    def sleep(seconds: float) -> None:  # the notice arrives during the first slice of the wait
        woke.append(clock.now)
        clock.advance(seconds)
        watch.value = NOTICE

    a.sleep = sleep
    a.wait(3.0)
    assert len(woke) == 1, "the wait ends at the next 0.1 s slice after the notice"
    assert a.run_cycle().action is Action.DRAIN_NOTICE
    r = record(registry)
    assert (r.state, r.notice, r.notice_time, r.drain_reason, r.drain_until) == (
        DRAINING, "gcp-preempted", T0, "", 0.0)  # fmt: skip
    assert a.run_cycle().action is Action.HEARTBEAT
    assert registry.get("node-a") is not None, "the lease is kept: the record stays until the machine is gone"


def test_an_operator_undrain_an_eviction_or_a_lost_lease_never_makes_a_noticed_host_ready() -> None:
    a, registry, watch, clock = agent()
    a.run_cycle()
    evict(registry, "node-a", reason="hung", cooldown_seconds=3, now=T0 - 100, min_np=0)
    watch.value = NOTICE
    assert a.run_cycle().action is Action.DRAIN_NOTICE
    assert record(registry).drain_until == 0.0, "the notice replaces the eviction: no readmission"
    for _ in range(3):
        clock.advance(3.0)
        assert a.run_cycle().action is Action.HEARTBEAT and record(registry).state == DRAINING
    set_state(registry, "node-a", READY)
    assert a.run_cycle().action is Action.DRAIN_NOTICE and record(registry).state == DRAINING
    registry.lose_everything()
    d = a.run_cycle()
    assert (d.action, d.reason) == (Action.REGISTER, f"lease lost; {SAYS}; registering node-a (2 slots) as draining "
                                    "under a new 9s lease")  # fmt: skip
    r = record(registry)
    assert (r.state, r.notice, r.notice_time, r.drain_until) == (DRAINING, "gcp-preempted", T0, 0.0)


# -- plan_checkpoint(): can the job survive the notices? --------------------------------------------------------


def host(name: str, slots: int = 1, state: str = READY, notice: float = 0.0) -> HostRecord:
    r = HostRecord(host=name, slots=slots, addr="127.0.0.1", state=state)
    return r.with_notice("aws-spot-terminate", notice) if notice else r


def test_no_notice_or_enough_slots_left_needs_no_checkpoint() -> None:
    assert plan_checkpoint([host("a"), host("b")], min_np=2) is None, "no notice"
    assert plan_checkpoint([host("a"), host("b"), host("c", notice=T0)], min_np=2) is None, "2 slots stay"
    assert plan_checkpoint([host("a", slots=4), host("b", slots=4, notice=T0)], min_np=4) is None


def test_every_host_noticed_needs_a_checkpoint_before_the_earliest_end() -> None:
    plan = plan_checkpoint([host("b", notice=T0 + 30), host("a", notice=T0)], min_np=1)
    assert plan == CheckpointPlan(deadline=T0, slots_left=0, noticed=("a", "b"))
    assert plan.describe(T0 - 25) == (
        "2 host(s) with a preemption notice (a, b) leave 0 slot(s), fewer than min_np; a just-in-time checkpoint is "
        "due within 25s"
    )


def test_a_notice_that_leaves_fewer_than_min_np_slots_needs_a_checkpoint() -> None:
    records = [host("a", slots=2), host("b", slots=2, notice=T0), host("c", slots=2, state=DRAINING)]
    plan = plan_checkpoint(records, min_np=3)
    assert plan is not None and (plan.slots_left, plan.noticed, plan.deadline) == (2, ("b",), T0)
    assert plan_checkpoint(records, min_np=2) is None
    assert plan_checkpoint([host("a", notice=T0)], min_np=0) is not None, "no host left at all is never enough"


def test_hosts_list_shows_the_notice_and_the_time_left() -> None:
    from discovery.hosts_cli import format_state

    assert format_state(host("a", notice=T0), T0 - 95) == "draining (aws-spot-terminate, ends in 95s)"
    assert format_state(host("a", notice=T0), T0 + 1) == "draining (aws-spot-terminate, ending)"
    assert format_state(host("a"), T0) == "ready"


def test_an_azure_time_without_a_zone_is_utc() -> None:
    event = azure_event(NotBefore="Sun, 06 Dec 2026 06:20:00 -0000")
    assert parse_azure_events(azure_events(event), "vm-1", T0 - 60) == Notice("azure", "preempt", T0)


def test_auto_is_not_held_by_a_question_that_never_returns() -> None:
    import threading
    import time

    release = threading.Event()

    def stuck(method: str, url: str, headers: Mapping[str, str], timeout: float) -> Answer:
        release.wait(30)  # a name lookup that the request's deadline does not bound
        raise NoticeError("no answer")

    start = time.monotonic()
    try:
        assert probe({}, timeout_seconds=0.2, request=stuck) is None
        assert time.monotonic() - start < 5.0, "0.2 s and a little, whatever the machine's load"
    finally:
        release.set()
