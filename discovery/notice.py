"""The cloud's preemption notice: what it is, how each cloud's answer reads, and what a reader of the host records
decides from it. Pure: no I/O (the metadata services are read by :mod:`discovery.noticewatch`).

Contract:

- The parsers (``parse_*``) take an answer's body (and the time it was read) and return a :class:`Notice`,
  ``None`` (no notice) or raise :class:`NoticeError` (one line). A notice's ``time`` is when the cloud ends the
  instance: the time the cloud gives (AWS, Azure), else ``now`` plus the warning the cloud documents (GCP: 30 s for
  a preemption, 60 s for a host maintenance that terminates).
- :func:`plan_checkpoint` is the reader's side: from the job's host records it says whether the notices leave the
  job unable to go on (fewer than ``min_np`` slots on ready hosts with no notice) and by when a just-in-time
  checkpoint must be durable.
"""

from __future__ import annotations

import calendar
import datetime
import email.utils
import json
import time
from dataclasses import dataclass
from typing import Any

from discovery.record import READY, HostRecord
from discovery.wire import check_notice, check_time
from elastictrain.errors import ElastictrainError

CLOUDS = ("aws", "gcp", "azure")
MAX_EVENTS = 100
"""Most Azure scheduled events read from one answer."""
AWS_ACTIONS = ("terminate", "stop", "hibernate")
GCP_PREEMPTION_SECONDS = 30.0
"""Warning GCP documents between ``instance/preempted`` turning ``TRUE`` and the stop."""
GCP_MAINTENANCE_SECONDS = 60.0
"""Warning GCP documents between ``maintenance-event`` changing and the maintenance."""
AZURE_EVENT_TYPES = {"Preempt": "preempt", "Terminate": "terminate"}
"""Azure scheduled events that end the VM, and the kind recorded for each."""


class NoticeError(ElastictrainError):
    """A metadata service could not be read, or answered something that is not its protocol (one line)."""


@dataclass(frozen=True, slots=True)
class Notice:
    """A cloud's word that this instance is going away."""

    cloud: str
    """``aws``, ``gcp`` or ``azure``."""
    kind: str
    """The event, as a token: ``spot-terminate``, ``spot-stop``, ``spot-hibernate`` (AWS), ``preempted``,
    ``maintenance`` (GCP), ``preempt``, ``terminate`` (Azure)."""
    time: float
    """Unix time at which the cloud ends the instance."""

    def __post_init__(self) -> None:
        check_notice(self.token)
        check_time("notice time", self.time)

    @property
    def token(self) -> str:
        """What the host's etcd record keeps in ``notice``: ``<cloud>-<kind>``."""
        return f"{self.cloud}-{self.kind}"

    def describe(self) -> str:
        """One line for the agent's log: ``preemption notice aws-spot-terminate: the instance ends at <UTC>``."""
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time))
        return f"preemption notice {self.token}: the instance ends at {when}"


# -- parsers (pure) ---------------------------------------------------------------------------------


def _json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError too; RecursionError: nesting deeper than Python's stack
        raise NoticeError(f"{what}: the answer is not JSON") from None
    if not isinstance(data, dict):
        raise NoticeError(f"{what}: the answer is not a JSON object")
    return data


def plain_text(body: bytes, what: str) -> str:
    try:
        text = body.decode("ascii").strip()
    except UnicodeDecodeError:
        raise NoticeError(f"{what}: the answer is not ASCII text") from None
    if len(text) > 64 or not text.isprintable():
        raise NoticeError(f"{what}: unexpected answer {ascii(text)[:40]}")
    return text


def parse_iso_utc(value: object, what: str) -> float:
    """Unix time of an AWS time (``2026-12-06T05:10:00Z``; fractional seconds allowed)."""
    if not isinstance(value, str) or len(value) > 40:
        raise NoticeError(f"{what}: expected a UTC time like 2026-12-06T05:10:00Z, got {ascii(value)[:40]}")
    text = value.split(".", 1)[0].rstrip("Z") if value.endswith("Z") else ""
    try:
        parsed = time.strptime(text, "%Y-%m-%dT%H:%M:%S")
        return check_time(what, float(calendar.timegm(parsed)))
    except ValueError:
        raise NoticeError(f"{what}: expected a UTC time like 2026-12-06T05:10:00Z, got {ascii(value)[:40]}") from None


def parse_aws_instance_action(body: bytes) -> Notice:
    """``GET /latest/meta-data/spot/instance-action`` answered 200: ``{"action": ..., "time": ...}``."""
    data = _json_object(body, "aws spot/instance-action")
    action = data.get("action")
    if action not in AWS_ACTIONS:
        raise NoticeError(f"aws spot/instance-action: action must be one of {AWS_ACTIONS}, got {ascii(action)[:40]}")
    return Notice("aws", f"spot-{action}", parse_iso_utc(data.get("time"), "aws spot/instance-action time"))


def parse_aws_rebalance(body: bytes) -> float:
    """``GET /latest/meta-data/events/recommendations/rebalance`` answered 200: its ``noticeTime`` (Unix time)."""
    data = _json_object(body, "aws rebalance recommendation")
    return parse_iso_utc(data.get("noticeTime"), "aws rebalance recommendation noticeTime")


def parse_gcp_preempted(body: bytes, now: float) -> Notice | None:
    """``GET instance/preempted``: ``TRUE`` once the VM is being preempted (it stops about 30 s later)."""
    text = plain_text(body, "gcp instance/preempted")
    if text == "FALSE":
        return None
    if text == "TRUE":
        return Notice("gcp", "preempted", now + GCP_PREEMPTION_SECONDS)
    raise NoticeError(f"gcp instance/preempted: expected TRUE or FALSE, got {ascii(text)[:40]}")


def parse_gcp_maintenance(body: bytes, now: float) -> Notice | None:
    """``GET instance/maintenance-event``: ``TERMINATE_ON_HOST_MAINTENANCE`` (60 s ahead) ends the VM;
    ``NONE`` and ``MIGRATE_ON_HOST_MAINTENANCE`` (a live migration: the VM keeps running) do not."""
    text = plain_text(body, "gcp instance/maintenance-event")
    if text == "TERMINATE_ON_HOST_MAINTENANCE":
        return Notice("gcp", "maintenance", now + GCP_MAINTENANCE_SECONDS)
    if text in ("NONE", "MIGRATE_ON_HOST_MAINTENANCE"):
        return None
    raise NoticeError(f"gcp instance/maintenance-event: unexpected value {ascii(text)[:40]}")


def parse_azure_time(value: object, now: float) -> float:
    """An event's ``NotBefore`` (RFC 1123, ``Mon, 19 Sep 2016 18:29:47 GMT``); empty once the event started."""
    if value == "":
        return now
    if not isinstance(value, str) or len(value) > 40:
        raise NoticeError(f"azure scheduled event NotBefore: expected an RFC 1123 time, got {ascii(value)[:40]}")
    try:
        when = email.utils.parsedate_to_datetime(value)
        if when.tzinfo is None:  # "-0000": RFC 5322's UTC with no zone information
            when = when.replace(tzinfo=datetime.timezone.utc)
        return check_time("azure scheduled event NotBefore", when.timestamp())
    except (TypeError, ValueError, OverflowError):
        raise NoticeError(
            f"azure scheduled event NotBefore: expected an RFC 1123 time, got {ascii(value)[:40]}"
        ) from None


def parse_azure_events(body: bytes, vm_name: str, now: float) -> Notice | None:
    """``GET /metadata/scheduledevents``: the first-ending ``Preempt`` or ``Terminate`` event naming ``vm_name`` in
    its ``Resources``; ``None`` when no such event is listed (other events: reboots, redeploys, freezes)."""
    data = _json_object(body, "azure scheduledevents")
    events = data.get("Events")
    if not isinstance(events, list):
        raise NoticeError("azure scheduledevents: Events is not a list")
    if len(events) > MAX_EVENTS:
        raise NoticeError(f"azure scheduledevents: {len(events)} events, more than {MAX_EVENTS}")
    found: list[Notice] = []
    for event in events:
        if not isinstance(event, dict):
            raise NoticeError("azure scheduledevents: an event is not an object")
        event_type = event.get("EventType")
        kind = AZURE_EVENT_TYPES.get(event_type) if isinstance(event_type, str) else None
        resources = event.get("Resources")
        if not isinstance(resources, list):
            raise NoticeError("azure scheduledevents: an event's Resources is not a list")
        if kind is None or vm_name not in resources:
            continue
        found.append(Notice("azure", kind, parse_azure_time(event.get("NotBefore", ""), now)))
    return min(found, key=lambda n: n.time, default=None)


# -- the reader's decision: a just-in-time checkpoint --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckpointPlan:
    """The job cannot survive the notices given: save the last commit before ``deadline``."""

    deadline: float
    """Unix time of the earliest notice's end: the checkpoint must be durable before it."""
    slots_left: int
    """Slots on ready hosts with no notice (fewer than ``min_np``)."""
    noticed: tuple[str, ...]
    """Hosts with a notice, sorted."""

    def describe(self, now: float) -> str:
        return (
            f"{len(self.noticed)} host(s) with a preemption notice ({', '.join(self.noticed)}) leave "
            f"{self.slots_left} slot(s), fewer than min_np; a just-in-time checkpoint is due within "
            f"{self.deadline - now:.0f}s"
        )


def plan_checkpoint(records: list[HostRecord], min_np: int) -> CheckpointPlan | None:
    """Whether the preemption notices in ``records`` (the job's hosts as etcd lists them) leave the job unable to
    go on: ``None`` when no host has a notice, or when the ready hosts without one still have ``min_np`` slots (the
    job shrinks and goes on: a drain, nothing lost). Otherwise (every host noticed, or too few slots left) a
    :class:`CheckpointPlan` whose deadline is the earliest notice's end. Pure: records in, a plan out; what is
    written in etcd was validated when read (:meth:`HostRecord.from_json`)."""
    noticed = sorted((r for r in records if r.notice), key=lambda r: r.host)
    if not noticed:
        return None
    slots_left = sum(r.slots for r in records if r.state == READY and not r.notice)
    if slots_left >= max(min_np, 1):
        return None
    return CheckpointPlan(
        deadline=min(r.notice_time for r in noticed), slots_left=slots_left, noticed=tuple(r.host for r in noticed)
    )
