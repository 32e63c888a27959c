"""What the workers write for the launcher, carried through etcd to the launcher's run_dir when they share no disk.

The run_dir's records that workers write (the event log, the sample ledger, the workers' error records, the resolved
config) are *streams*: a run_dir-relative name and bytes. With ``elastic.outputs: files`` (the default) a writer
puts them in the run_dir itself, which every node shares. With ``etcd`` a writer hands them to its process's
:class:`Outbox`, and the launcher's :class:`Collector` writes them into its own run_dir, the only one that lasts:

- :class:`Outbox` (a worker): :meth:`Outbox.append` queues and returns, never waiting on etcd; one daemon thread puts
  what is queued, in order, as chunks of at most :data:`CHUNK_BYTES` under ``<prefix>/<job>/outbox/<writer>/<seq>``
  (``writer``: this process's token; ``seq``: 0, 1, ...). A failed put is retried with the same key and bytes, so a
  writer's sequence has no hole; a record longer than a chunk spans several (``more``), applied only whole.
- :class:`Collector` (the launcher): :meth:`Collector.collect` reads the outbox (bounded), checks every key and chunk
  (a known stream name, bounded sizes, each writer's sequence contiguous), applies whole records in the order etcd
  received them (appends, or an atomic replace for a whole-file stream), fsyncs, records what it applied in
  ``run_dir/.outbox.json`` (atomically), and only then deletes the applied keys. A crash anywhere in that order loses
  and repeats nothing: at start, a file longer than recorded is cut back (that tail came from chunks still in etcd),
  and chunks below a writer's recorded next sequence are only deleted. A writer's ledger stream gets its tenure
  number from the collector, in the order in which processes held rank 0.

Why etcd: every node already reaches it (discovery), it orders the chunks of every writer (revisions), and a put is
one round trip off the training thread; the records are small (a few KiB per step). A record still queued when its
writer is killed is lost. For the ledger the next rank 0 records the committed steps of its step log again when it
restores them (:meth:`~elastictrain.engine.services.Rank0Services.restore_ledger`: the last four commits' steps), so
only a backlog older than that (etcd unreachable over several commits, then rank 0 killed) leaves a gap, which
``elastictrain audit`` reports. The queue is not bounded (dropping a record would break the ledger for sure); past
:data:`QUEUED_WARN_BYTES` the outbox says so once per outage.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from elastictrain.errors import InputError
from elastictrain.fileio import write_atomic
from elastictrain.logconf import get_logger
from elastictrain.rundir import layout
from elastictrain.rundir.ledger import next_tenure_seq, tenure_name

log = get_logger("elastictrain.rundir.outbox")

CHUNK_BYTES = 256 * 1024
"""Most bytes of one chunk (etcd's default request limit is 1.5 MiB)."""
HEADER_BYTES = 512
"""Most bytes of a chunk's header line."""
COLLECT_KEYS = 200
"""Most chunks one :meth:`Collector.collect` reads (the rest wait for the next): at most about 50 MiB in one answer,
within the client's limit (``discovery.registry.MAX_RECEIVE_BYTES``)."""
RETRY_SECONDS = (0.25, 5.0)
"""A failed put is retried after the first delay, doubling up to the second."""
QUEUED_WARN_BYTES = 64 * 1024 * 1024
"""Bytes queued (etcd unreachable) above which the outbox says so, once per outage."""
STATE_VERSION = 1
_SEQ_DIGITS = 12
_TOKEN = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_NAME = r"[A-Za-z0-9_.-]{1,100}"
_APPEND_STREAMS = re.compile(rf"^({re.escape(layout.EVENTS)}|{re.escape(layout.LEDGER)}/{_NAME}(@\d{{1,9}})?\.jsonl)$")
"""The run log, and a ledger stream: ``ledger/<name>@<opening>.jsonl`` (each opening of a ledger in a process is a
tenure of its own; the file is ``tenure-<n>-<name>.jsonl``)."""
_WHOLE_STREAMS = re.compile(
    rf"^({re.escape(layout.CONFIG)}|{re.escape(layout.REPORT_JSON)}|{re.escape(layout.MLFLOW_RUN_ID)}"
    rf"|{re.escape(layout.WORKER_ERRORS)}/{_NAME}\.json)$"
)


class KeyValue(Protocol):
    """What the outbox needs of etcd (:class:`discovery.kv.KeyValue`); every call may raise ``RegistryError``."""

    def put(self, key: str, value: bytes, lease_id: int = 0) -> None: ...

    def get_prefix(self, prefix: str, limit: int) -> list[tuple[str, bytes, int]]: ...

    def delete_if(self, key: str, mod_revision: int) -> bool: ...

    def close(self) -> None: ...


def outbox_prefix(prefix: str, job: str) -> str:
    """``<prefix>/<job>/outbox/``: every chunk of ``job`` is under it."""
    return f"{prefix.rstrip('/')}/{job}/outbox/"


def writer_token(host: str, pid: int | None = None) -> str:
    """A token for this process, unique across the job's life: host, pid and the time it was made."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", host)[:64] or "host"
    return f"{safe}.{os.getpid() if pid is None else pid}.{time.time_ns()}"


def stream_kind(stream: str) -> str | None:
    """``append`` or ``whole`` for a stream the outbox carries; None for any other name."""
    if _APPEND_STREAMS.match(stream):
        return "append"
    if _WHOLE_STREAMS.match(stream):
        return "whole"
    return None


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk as read from etcd: a piece of a writer's stream."""

    writer: str
    seq: int
    stream: str
    more: bool
    """A later chunk of the same writer continues this record."""
    data: bytes
    revision: int
    key: str

    def encode(self) -> bytes:
        return encode_chunk(self.stream, self.more, self.data)

    @classmethod
    def parse(cls, key: str, raw: bytes, revision: int, prefix: str) -> Chunk:
        """The chunk at ``key``; ``ValueError`` (one line) when the key or the value is not a valid chunk."""
        if not key.startswith(prefix):
            raise ValueError("key outside the outbox")
        parts = key[len(prefix) :].split("/")
        if len(parts) != 2 or not _TOKEN.match(parts[0]) or not re.fullmatch(rf"\d{{{_SEQ_DIGITS}}}", parts[1]):
            raise ValueError("key is not <writer>/<seq>")
        if len(raw) > CHUNK_BYTES + HEADER_BYTES:
            raise ValueError(f"chunk of {len(raw)} bytes is too large")
        head, sep, data = raw.partition(b"\n")
        if not sep or len(head) > HEADER_BYTES:
            raise ValueError("no header line")
        try:
            header = json.loads(head)
        except (ValueError, UnicodeDecodeError):
            raise ValueError("header is not JSON") from None
        if not isinstance(header, dict) or header.get("v") != 1:
            raise ValueError("header is not a version-1 object")
        stream, more = header.get("stream"), header.get("more")
        if not isinstance(stream, str) or stream_kind(stream) is None:
            raise ValueError(f"unknown stream {str(stream)[:80]!r}")
        if not isinstance(more, bool) or len(data) > CHUNK_BYTES:
            raise ValueError("bad 'more' or data size")
        return cls(parts[0], int(parts[1]), stream, more, data, revision, key)


def encode_chunk(stream: str, more: bool, data: bytes) -> bytes:
    return json.dumps({"v": 1, "stream": stream, "more": more}, separators=(",", ":")).encode() + b"\n" + data


# ---------------------------------------------------------------------------------------------- the worker's side
class Outbox:
    """A worker's records for the launcher, put in etcd by one daemon thread (see the module docstring)."""

    def __init__(self, store: KeyValue, prefix: str, writer: str) -> None:
        if not _TOKEN.match(writer):
            raise ValueError(f"writer token {writer!r} must match {_TOKEN.pattern}")
        self.store = store
        self.prefix = prefix
        self.writer = writer
        self._queue: deque[tuple[str, bytes]] = deque()
        self._queued_bytes = 0
        self._seq = 0
        self._head_sent = 0
        self._appended = 0
        self._sent = 0
        self._cond = threading.Condition()
        self._closed = False
        self._warned = False
        self.put_errors = 0
        self._thread = threading.Thread(target=self._run, name="elastictrain-outbox", daemon=True)
        self._thread.start()

    def append(self, stream: str, data: bytes) -> None:
        """Queue ``data`` for ``stream`` (a whole record: lines of an append stream, or a whole file); returns at
        once. ``ValueError`` for a stream the outbox does not carry (a programming error)."""
        if stream_kind(stream) is None:
            raise ValueError(f"the outbox carries no stream {stream!r}")
        with self._cond:
            if self._closed:
                log.debug("outbox_append_after_close", stream=stream)
                return
            self._queue.append((stream, bytes(data)))
            self._queued_bytes += len(data)
            self._appended += 1
            if self._queued_bytes > QUEUED_WARN_BYTES and not self._warned:
                self._warned = True
                log.warning("outbox_backlog", queued_bytes=self._queued_bytes)
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record appended so far is in etcd; False when ``timeout`` ran out first."""
        with self._cond:
            target = self._appended
            return self._cond.wait_for(lambda: self._sent >= target, timeout=timeout)

    def close(self, timeout: float = 10.0) -> bool:
        """Put what is queued (waiting at most ``timeout``), then stop the thread; True when nothing was left."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)
        if not done:
            log.warning("outbox_closed_with_backlog", records=self._appended - self._sent)
        return done

    def _run(self) -> None:
        delay = RETRY_SECONDS[0]
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                stream, data = self._queue[0]
            try:
                self._put_record(stream, data)
            except Exception as e:
                self.put_errors += 1
                if self.put_errors == 1 or self.put_errors % 100 == 0:
                    log.warning("outbox_put_failed", error=str(e)[:200], failures=self.put_errors)
                with self._cond:
                    if self._closed:
                        return
                    self._cond.wait(delay)
                delay = min(delay * 2, RETRY_SECONDS[1])
                continue
            delay = RETRY_SECONDS[0]
            with self._cond:
                self._queue.popleft()
                self._queued_bytes -= len(data)
                self._sent += 1
                if self._queued_bytes <= QUEUED_WARN_BYTES:
                    self._warned = False
                self._cond.notify_all()

    def _put_record(self, stream: str, data: bytes) -> None:
        """Put the head record as chunks from ``self._seq``. The sequence moves on only after a put succeeded, and
        :attr:`_head_sent` counts the head's chunks already put, so a retry puts the next chunk under its own key."""
        pieces = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
        while self._head_sent < len(pieces):
            i = self._head_sent
            key = f"{self.prefix}{self.writer}/{self._seq:0{_SEQ_DIGITS}d}"
            self.store.put(key, encode_chunk(stream, i < len(pieces) - 1, pieces[i]))
            self._seq += 1
            self._head_sent += 1
        self._head_sent = 0


_OPENED: dict[tuple[str, ...], Outbox] = {}


def open_outbox(choice: str, environ: Mapping[str, str] | None = None) -> Outbox | None:
    """This process's outbox for ``elastic.outputs`` = ``choice``: None for ``files``; for ``etcd``, one
    :class:`Outbox` per process and etcd (the job's, as the environment names it). Raises ``ConfigError`` (one line)
    for an etcd the environment names badly."""
    from elastictrain import envnames
    from elastictrain.config import etcd_transport

    env = os.environ if environ is None else environ
    if etcd_transport("elastic.outputs", choice, env) == "files":
        return None
    key = (env.get(envnames.ETCD, ""), env.get(envnames.ETCD_PREFIX, ""), env.get(envnames.JOB, ""))
    if key not in _OPENED:
        from discovery import kv

        store, prefix, job = kv.from_env(env)
        host = env.get("HOROVOD_HOSTNAME") or socket.gethostname()
        _OPENED[key] = Outbox(store, outbox_prefix(prefix, job), writer_token(host))
    return _OPENED[key]


def current_outbox() -> Outbox | None:
    """The outbox this process opened (:func:`open_outbox` with ``etcd``), or None: for writers that learn late that
    they have something for the launcher (the tracker's run id)."""
    return next(iter(_OPENED.values()), None)


os.register_at_fork(after_in_child=_OPENED.clear)  # no thread crosses a fork: a child opens its own


# -------------------------------------------------------------------------------------------- the launcher's side
@dataclass(slots=True)
class _Unit:
    """A whole record of one writer: its chunks in order."""

    writer: str
    chunks: list[Chunk]
    order: int
    """When the store had the whole record (its last chunk's revision), never before an earlier record of its writer."""


class Collector:
    """Applies the job's outbox to ``run_dir`` (see the module docstring); one per run_dir, in the launcher."""

    def __init__(self, store: KeyValue, prefix: str, run_dir: str | os.PathLike[str]) -> None:
        self.store = store
        self.prefix = prefix
        self.run_dir = Path(run_dir)
        self.state_path = self.run_dir / layout.OUTBOX_STATE
        self.rejected = 0
        self.applied = 0
        self.state = self._load_state()
        self._recover()

    # -- state
    def _load_state(self) -> dict[str, Any]:
        empty: dict[str, Any] = {"v": STATE_VERSION, "files": {}, "writers": {}, "ledger": {}}
        try:
            state = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return empty
        except (OSError, ValueError) as e:
            raise OutboxStateError(f"{self.state_path}: unreadable ({e})") from None
        ok = (
            isinstance(state, dict)
            and state.get("v") == STATE_VERSION
            and _mapping_of(state.get("files"), lambda v: isinstance(v, int) and v >= 0)
            and _mapping_of(state.get("writers"), lambda v: isinstance(v, int) and v >= 0)
            and _mapping_of(state.get("ledger"), lambda v: isinstance(v, str) and stream_kind(v) == "append")
        )
        if not ok or any(stream_kind(f) != "append" for f in state["files"]):
            raise OutboxStateError(f"{self.state_path}: not an outbox state this version wrote")
        return state

    def _save_state(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.state_path, json.dumps(self.state, sort_keys=True) + "\n")

    def _recover(self) -> None:
        """Cut each stream file back to the size the state recorded: a longer tail came from chunks still in etcd."""
        for rel, size in list(self.state["files"].items()):
            path = self.run_dir / rel
            try:
                actual = path.stat().st_size
            except FileNotFoundError:
                actual = -1
            if actual == -1 and size == 0:
                continue
            if actual > size:
                with open(path, "r+b") as f:
                    f.truncate(size)
                    os.fsync(f.fileno())
                log.info("outbox_recovered", file=rel, cut_bytes=actual - size)
            elif actual < size:
                log.warning("outbox_file_shorter_than_recorded", file=rel, recorded=size, actual=max(actual, 0))
                self.state["files"][rel] = max(actual, 0)

    # -- one pass
    def collect(self) -> int:
        """Apply every whole record now in the outbox (at most :data:`COLLECT_KEYS` chunks); the count applied.
        Raises ``RegistryError`` when etcd cannot be read (nothing is applied then)."""
        rows = self.store.get_prefix(self.prefix, COLLECT_KEYS)
        by_writer: dict[str, list[Chunk]] = {}
        stale: list[tuple[str, int]] = []
        for key, raw, revision in rows:
            try:
                chunk = Chunk.parse(key, raw, revision, self.prefix)
            except ValueError as e:
                self.rejected += 1
                log.warning("outbox_chunk_rejected", key=key[:200], reason=str(e))
                stale.append((key, revision))
                continue
            if chunk.seq < self.state["writers"].get(chunk.writer, 0):
                stale.append((key, revision))  # applied before a crash that came before its delete
            else:
                by_writer.setdefault(chunk.writer, []).append(chunk)
        units = [u for writer, chunks in by_writer.items() for u in self._units(writer, chunks)]
        units.sort(key=lambda u: u.order)
        self._register_targets(units)
        touched: dict[str, int] = {}
        handles: dict[str, Any] = {}
        applied_state = json.loads(json.dumps(self.state))  # what is recorded only once the writes are durable
        try:
            for unit in units:
                self._apply(unit, handles, touched)
            for f in handles.values():
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            self.state = applied_state  # nothing of this pass counts: cut back, and the keys stay for the next pass
            self._recover()
            raise
        finally:
            for f in handles.values():
                f.close()
        if units:
            self.state["files"].update(touched)
            self._save_state()
            self.applied += len(units)
        for chunk in (c for u in units for c in u.chunks):
            stale.append((chunk.key, chunk.revision))
        for key, revision in stale:
            with contextlib.suppress(Exception):  # a key left behind is deleted by a later pass
                self.store.delete_if(key, revision)
        return len(units)

    def _units(self, writer: str, chunks: list[Chunk]) -> list[_Unit]:
        """The writer's whole records from its next sequence number on, stopping at a gap or an unfinished one."""
        chunks.sort(key=lambda c: c.seq)
        expected = self.state["writers"].get(writer, 0)
        units: list[_Unit] = []
        current: list[Chunk] = []
        order = 0
        for c in chunks:
            if c.seq != expected or (current and c.stream != current[0].stream):
                break
            current.append(c)
            expected += 1
            order = max(order, c.revision)
            if not c.more:
                units.append(_Unit(writer, current, order))
                current = []
        return units

    def _register_targets(self, units: list[_Unit]) -> None:
        """Record each append target the units will write that the state does not know yet, with its size now, and
        save the state before anything is written: a crash in the middle is then cut back like any other."""
        new = False
        for unit in units:
            if stream_kind(unit.chunks[0].stream) != "append":
                continue
            rel = self._target(unit.writer, unit.chunks[0].stream)
            if rel not in self.state["files"]:
                with contextlib.suppress(FileNotFoundError):
                    self.state["files"][rel] = (self.run_dir / rel).stat().st_size
                self.state["files"].setdefault(rel, 0)
                new = True
        if new:
            self._save_state()

    def _target(self, writer: str, stream: str) -> str:
        """The run_dir path of ``stream``: a ledger stream becomes the next ``tenure-<n>-<name>.jsonl``."""
        if not stream.startswith(layout.LEDGER + "/"):
            return stream
        key = f"{writer}/{stream}"
        if key not in self.state["ledger"]:
            name = stream.split("/", 1)[1].removesuffix(".jsonl").split("@", 1)[0]
            seq = next_tenure_seq(self.run_dir / layout.LEDGER, self.state["ledger"].values())
            self.state["ledger"][key] = f"{layout.LEDGER}/{tenure_name(seq, name)}"
        target: str = self.state["ledger"][key]
        return target

    def _apply(self, unit: _Unit, handles: dict[str, Any], touched: dict[str, int]) -> None:
        stream = unit.chunks[0].stream
        data = b"".join(c.data for c in unit.chunks)
        if stream_kind(stream) == "whole":
            path = self.run_dir / stream
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, data)
        else:
            rel = self._target(unit.writer, stream)
            f = handles.get(rel)
            if f is None:
                path = self.run_dir / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                f = handles[rel] = open(path, "ab")  # noqa: SIM115 - closed by collect()
            f.write(data)
            touched[rel] = f.tell()
        self.state["writers"][unit.writer] = unit.chunks[-1].seq + 1

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.store.close()


class OutboxStateError(InputError):
    """``run_dir/.outbox.json`` cannot be trusted; the message is one line."""


def _mapping_of(value: object, ok: Callable[[Any], bool]) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, str) and ok(v) for k, v in value.items())
