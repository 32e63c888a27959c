"""Experiment tracking that never stalls a training step: one MLflow run per job, sent from a thread.

The worker holds a :class:`Tracker` built by :func:`make_tracker`: an :class:`MlflowTracker` on rank 0
when ``tracking.mlflow`` is on, a :class:`NullTracker` everywhere else. Every call returns at once:
it puts an item on a bounded queue (``tracking.queue_size``) that a sender thread turns into MLflow
requests. When the queue is full, or a request fails after MLflow's own bounded retries, the points
are dropped, counted in :attr:`Tracker.dropped` and warned about (at most once a minute).

Two invariants hold here, not in the worker:

* **One run per job.** The run id is kept in ``run_dir/mlflow_run_id`` (written atomically) and
  reused by every later tracker of the job (after a reset, a relaunch or a resume); when that file is
  missing the run is found by its tags ``elastictrain.job`` and ``elastictrain.run_dir``, and only
  then is a new run created.
* **No (step, metric) point twice.** The sender keeps the highest step sent per metric and skips a
  point at or below it (a rollback re-runs steps and the worker logs them again). On resume the
  high-water marks are read once from the store, by the sender thread.
* **No hole after a killed rank 0.** Points a SIGKILLed rank 0 had queued (at most
  ``tracking.flush_seconds`` of them) never reach the store, but its ``events.jsonl`` has them. When a
  tracker opens an existing run it backfills, once, every point of the run log above the store's
  high-water marks (:func:`backfill_points`: the points the dead sender would have sent), before anything
  queued. The points come from the events by :func:`event_metrics`, the same values the worker logs.

``import mlflow`` (seconds of CPU) happens in the sender thread, so building a tracker costs nothing.

Size: one lifecycle and one thread for every MLflow call (docs/decisions.md).
"""

from __future__ import annotations

import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from elastictrain import envnames, fileio
from elastictrain.errors import one_line
from elastictrain.logconf import get_logger
from elastictrain.rundir import layout
from elastictrain.rundir.events import Checkpoint, EpochEnd, Event, Metrics, Reset, read_events
from elastictrain.rundir.outbox import current_outbox

if TYPE_CHECKING:
    from elastictrain.config import JobConfig

log = get_logger("elastictrain.engine.tracking")

TAG_JOB = "elastictrain.job"
TAG_RUN_DIR = "elastictrain.run_dir"
# MLflow's limits per log_batch request and per value.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
# Environment defaults for the sender (a user's value wins). What its HTTP requests may cost: MLflow's defaults
# are 7 retries and 120 s per request. MLflow 3 also starts a telemetry thread in rank 0's process that reports
# usage over the network; it is off unless the user sets MLFLOW_DISABLE_TELEMETRY=false.
SENDER_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
}


# --------------------------------------------------------------------------------------- interface
class Tracker(Protocol):
    """What the worker calls. Every method returns at once and never raises for tracking failures."""

    @property
    def run_id(self) -> str | None:
        """The MLflow run id once the sender has opened the run (None before, and for NullTracker)."""
        ...

    @property
    def dropped(self) -> int:
        """Values (metric points, params, tags, artifacts) lost to a full queue or failed requests."""
        ...

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Once per worker start: the resolved config (``cfg.flat()``). Values that the run already has
        are skipped; a changed value is recorded as tag ``elastictrain.param_changed.<key>``."""
        ...

    def log_metrics(self, metrics: Mapping[str, float | int | None], step: int) -> None:
        """On logging steps: ``None`` values are ignored; points at or below the metric's highest
        step sent so far are skipped."""
        ...

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """At start and whenever the host list changes; a tag keeps its latest value."""
        ...

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """A file to attach to the run; it is read when the sender gets to it."""
        ...

    def wait_started(self, timeout: float) -> str | None:
        """Wait up to ``timeout`` s for the run to be opened; the run id or None. Not for the hot path."""
        ...

    def close(self, status: str | None = "FINISHED", timeout: float = 30.0) -> None:
        """When the worker leaves: send what is queued (at most ``timeout`` s), then mark the run
        ``status`` (FINISHED when training is complete, KILLED when stopped, FAILED on error). ``None`` leaves
        the run open: rank 0 moved to another process, which carries on in the same run."""
        ...


class NullTracker:
    """Tracking off, or a rank other than 0: every call does nothing."""

    run_id: str | None = None
    dropped: int = 0

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float | int | None], step: int) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        pass

    def wait_started(self, timeout: float) -> str | None:
        return None

    def close(self, status: str | None = "FINISHED", timeout: float = 30.0) -> None:
        pass


# ----------------------------------------------------------------------------------------- backend
@dataclass(frozen=True, slots=True)
class MetricPoint:
    key: str
    value: float
    timestamp_ms: int
    step: int


@dataclass(slots=True)
class OpenedRun:
    """What a backend found or created for the job."""

    run_id: str
    resumed: bool
    high_water: dict[str, int] = field(default_factory=dict)
    """Highest step stored per metric key."""
    params: dict[str, str] = field(default_factory=dict)
    """Params the run already has."""


class TrackingBackend(Protocol):
    """The store behind :class:`MlflowTracker`; called from the sender thread only. Any exception is a
    failed request (the tracker counts and warns); implementations do their own bounded retries."""

    def open_run(self, *, existing_run_id: str | None, job: str, run_dir: str, experiment: str) -> OpenedRun:
        """Return the run ``existing_run_id`` when the store has it (active), else the run tagged with
        ``job`` and ``run_dir``, else a new one tagged so. Mark it running."""
        ...

    def log_batch(
        self, run_id: str, metrics: list[MetricPoint], params: dict[str, str], tags: dict[str, str]
    ) -> None: ...

    def log_artifact(self, run_id: str, path: str, artifact_path: str | None) -> None: ...

    def finish(self, run_id: str, status: str) -> None: ...


class MlflowBackend:
    """:class:`TrackingBackend` over ``mlflow.MlflowClient`` (imported on first use, in the sender)."""

    def __init__(self, tracking_uri: str, *, artifact_location: str | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.artifact_location = artifact_location
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            from mlflow import MlflowClient

            _create_sqlite_store_atomically(self.tracking_uri)
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            try:
                return str(self.client.create_experiment(name, artifact_location=self.artifact_location))
            except MlflowException as e:  # another job created it meanwhile
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = self.client.get_experiment_by_name(name)
                assert exp is not None
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp.experiment_id)
        return str(exp.experiment_id)

    def open_run(self, *, existing_run_id: str | None, job: str, run_dir: str, experiment: str) -> OpenedRun:
        from mlflow.exceptions import MlflowException

        run = None
        if existing_run_id:
            try:
                run = self.client.get_run(existing_run_id)
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            if run is None or run.info.lifecycle_stage != "active":
                log.warning("tracking_run_not_found", run_id=existing_run_id, tracking_uri=self.tracking_uri)
                run = None
        exp_id = self._experiment_id(experiment)
        if run is None:
            flt = f"tags.`{TAG_JOB}` = '{job}'"
            if "'" not in run_dir and "\\" not in run_dir:
                flt += f" and tags.`{TAG_RUN_DIR}` = '{run_dir}'"
            found = self.client.search_runs(
                [exp_id], filter_string=flt, max_results=1, order_by=["attributes.start_time ASC"]
            )
            run = found[0] if found else None
        if run is None:
            created = self.client.create_run(exp_id, run_name=job, tags={TAG_JOB: job, TAG_RUN_DIR: run_dir})
            return OpenedRun(run_id=created.info.run_id, resumed=False)
        run_id = run.info.run_id
        self.client.update_run(run_id, status="RUNNING")
        return OpenedRun(
            run_id=run_id,
            resumed=True,
            high_water=self._high_water(run),
            params=dict(run.data.params),
        )

    def _high_water(self, run: Any) -> dict[str, int]:
        # MLflow's "latest" metric of a run is its point with the highest (step, timestamp): the run's
        # data carries it with its step, so one get_run gives every high-water mark.
        objs = getattr(run.data, "_metric_objs", None)
        if objs is not None:
            return {m.key: int(m.step) for m in objs}
        marks: dict[str, int] = {}  # pragma: no cover - older RunData without metric objects
        for key in run.data.metrics:  # pragma: no cover
            history = self.client.get_metric_history(run.info.run_id, key)
            marks[key] = max((int(m.step) for m in history), default=-1)
        return marks  # pragma: no cover

    def log_batch(self, run_id: str, metrics: list[MetricPoint], params: dict[str, str], tags: dict[str, str]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        self.client.log_batch(
            run_id,
            metrics=[Metric(m.key, m.value, m.timestamp_ms, m.step) for m in metrics],
            params=[Param(k, v) for k, v in params.items()],
            tags=[RunTag(k, v) for k, v in tags.items()],
            synchronous=True,
        )

    def log_artifact(self, run_id: str, path: str, artifact_path: str | None) -> None:
        self.client.log_artifact(run_id, path, artifact_path)

    def finish(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status)


def _create_sqlite_store_atomically(tracking_uri: str) -> None:
    """Create a new sqlite store under a temporary name and move it into place when its schema is complete.

    MLflow creates the schema in the file it is given, table after table: a rank 0 killed meanwhile must not
    leave a half-made ``mlflow.db`` that no later process can open, so the file appears whole or not at all.
    """
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return
    path = Path(tracking_uri[len(prefix) :])
    if path.exists() or str(path) in ("", ":memory:"):
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    path.parent.mkdir(parents=True, exist_ok=True)
    with fileio.atomic_path(path) as tmp:  # unpredictable: sqlite follows a symlink planted at a guessable name
        store = SqlAlchemyStore(f"{prefix}{tmp}", str(path.parent / "mlartifacts"))
        store.engine.dispose()


METRICS_EVENT_FIELDS = ("loss", "lr", "world_size", "samples_per_sec", "step_seconds", "commit_seconds")
"""Fields of a ``metrics`` event that the worker also logs to MLflow under the same names."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def event_metrics(event: Event) -> dict[str, float]:
    """The MLflow metrics the worker logs with a run-log event, at the event's ``step``: a ``metrics`` event's
    :data:`METRICS_EVENT_FIELDS`, an ``epoch_end``'s ``val_*`` values, a ``checkpoint``'s ``stall_seconds``
    (as ``checkpoint_stall_seconds``) and a ``reset``'s ``recovery_seconds``. Non-numbers are left out."""
    raw: dict[str, Any]
    if isinstance(event, Metrics):
        raw = {k: getattr(event, k) for k in METRICS_EVENT_FIELDS}
    elif isinstance(event, EpochEnd):
        raw = {k: v for k, v in event.fields().items() if k.startswith("val_")}
    elif isinstance(event, Checkpoint):
        raw = {"checkpoint_stall_seconds": event.stall_seconds}
    elif isinstance(event, Reset):
        raw = {"recovery_seconds": event.recovery_seconds}
    else:
        return {}
    return {k: n for k, v in raw.items() if (n := _number(v)) is not None}


def backfill_points(events: Sequence[Event], high_water: dict[str, int]) -> list[MetricPoint]:
    """The points of ``events`` (the run log, oldest first) that a sender starting from ``high_water`` would
    have sent: per metric, a point whose step is above every step sent before it. Updates ``high_water``."""
    points: list[MetricPoint] = []
    for e in events:
        for key, value in event_metrics(e).items():
            if e.step > high_water.get(key, -1):
                high_water[key] = e.step
                points.append(MetricPoint(key, value, int(e.ts * 1000), e.step))
    return points


def default_tracking_uri(run_dir: str | os.PathLike[str]) -> str:
    """``sqlite:///<abs run_dir>/mlflow.db``: the run's own store (MLflow's default is the cwd)."""
    return f"sqlite:///{Path(run_dir).resolve() / layout.MLFLOW_DB}"


def resolve_tracking_uri(
    configured: str | None, run_dir: str | os.PathLike[str], env: Mapping[str, str] | None = None
) -> str:
    """``tracking.tracking_uri``, else ``MLFLOW_TRACKING_URI``, else the sqlite store in ``run_dir``."""
    env = os.environ if env is None else env
    return configured or env.get("MLFLOW_TRACKING_URI") or default_tracking_uri(run_dir)


def write_atomic(path: Path, text: str) -> None:
    """Temp file in the same folder, fsync, rename over ``path``, fsync the folder
    (:func:`elastictrain.fileio.write_atomic`)."""
    fileio.write_atomic(path, text)


_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def read_run_id(run_dir: str | os.PathLike[str], environ: Mapping[str, str] | None = None) -> str | None:
    """The job's MLflow run id: ``run_dir/mlflow_run_id``, else the one the launcher passed
    (``ELASTICTRAIN_MLFLOW_RUN_ID``: a worker on a machine whose run_dir is empty); None when neither holds a valid
    one."""
    try:
        text = (Path(run_dir) / layout.MLFLOW_RUN_ID).read_text(errors="replace")[:200].strip()
    except OSError:
        text = ""
    if not text:
        text = (os.environ if environ is None else environ).get(envnames.MLFLOW_RUN_ID, "").strip()
    return text if _RUN_ID.fullmatch(text) else None


# ----------------------------------------------------------------------------------------- tracker
@dataclass(frozen=True, slots=True)
class _Metrics:
    values: dict[str, float]
    step: int
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class _Params:
    values: dict[str, str]


@dataclass(frozen=True, slots=True)
class _Tags:
    values: dict[str, str]


@dataclass(frozen=True, slots=True)
class _Artifact:
    path: str
    artifact_path: str | None


_Item = _Metrics | _Params | _Tags | _Artifact


def _size(item: _Item) -> int:
    return 1 if isinstance(item, _Artifact) else len(item.values)


class MlflowTracker:
    """Rank 0's tracker: a bounded queue and one sender thread in front of a :class:`TrackingBackend`.

    Build it with :func:`make_tracker`; tests pass ``backend_factory`` (a fake store) and a small
    ``queue_size``. The sender opens the run first (retrying with backoff while the store is
    unreachable; items wait in the queue meanwhile), then sends items in order, batching what is
    queued into one request. With ``flush_interval_seconds`` > 0 it waits that long after each
    request, so a steady stream of points costs one request per interval.
    """

    def __init__(
        self,
        *,
        run_dir: str | os.PathLike[str],
        job: str,
        experiment: str = "elastictrain",
        tracking_uri: str | None = None,
        queue_size: int = 10000,
        backend_factory: Callable[[], TrackingBackend] | None = None,
        warn_interval_seconds: float = 60.0,
        retry_backoff_seconds: tuple[float, float] = (1.0, 30.0),
        flush_interval_seconds: float = 0.0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.job = job
        self.experiment = experiment
        self.tracking_uri = tracking_uri or default_tracking_uri(run_dir)
        if backend_factory is None:
            for key, value in SENDER_ENV.items():  # before mlflow reads them; a user's value wins
                os.environ.setdefault(key, value)
            uri = self.tracking_uri
            artifacts = (
                (self.run_dir.resolve() / "mlartifacts").as_uri() if uri == default_tracking_uri(run_dir) else None
            )
            backend_factory = lambda: MlflowBackend(uri, artifact_location=artifacts)  # noqa: E731
        self._backend_factory = backend_factory
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=queue_size)
        self._warn_interval = warn_interval_seconds
        self._flush_interval = flush_interval_seconds
        self._backoff_min, self._backoff_max = retry_backoff_seconds
        self._lock = threading.Lock()
        self._dropped = 0
        self._skipped_duplicates = 0
        self._backfilled = 0
        self._in_flight = 0
        self._last_drop_warning = -math.inf
        self._run_id: str | None = None
        self._started = threading.Event()
        self._closing = threading.Event()
        self._abandon = threading.Event()
        self._final_status: str | None = "FINISHED"
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="elastictrain-tracking", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side (training thread)
    @property
    def run_id(self) -> str | None:
        return self._run_id

    @property
    def dropped(self) -> int:
        return self._dropped

    @property
    def skipped_duplicates(self) -> int:
        """Metric points not sent because their step was at or below the metric's high-water mark."""
        return self._skipped_duplicates

    @property
    def backfilled(self) -> int:
        """Metric points sent from the run log when the run was opened (see :func:`backfill_points`)."""
        return self._backfilled

    def log_params(self, params: Mapping[str, Any]) -> None:
        values = {str(k): str(v)[:MAX_PARAM_VALUE_LENGTH] for k, v in params.items()}
        if values:
            self._put(_Params(values))

    def log_metrics(self, metrics: Mapping[str, float | int | None], step: int) -> None:
        values: dict[str, float] = {}
        for key, value in metrics.items():
            if value is None:
                continue
            try:
                values[str(key)] = float(value)
            except (TypeError, ValueError):
                log.warning("tracking_metric_not_a_number", metric=key, value=repr(value))
        if values:
            self._put(_Metrics(values, int(step), int(time.time() * 1000)))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        values = {str(k): str(v)[:MAX_TAG_VALUE_LENGTH] for k, v in tags.items()}
        if values:
            self._put(_Tags(values))

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        self._put(_Artifact(os.fspath(path), artifact_path))

    def wait_started(self, timeout: float) -> str | None:
        self._started.wait(timeout)
        return self._run_id

    def close(self, status: str | None = "FINISHED", timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._final_status = status
        self._closing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._lock:  # from here on the sender counts nothing: what it holds is counted now
                self._abandon.set()
                left = self._drain_uncounted() + self._in_flight
            self._count_drop(left, "close_timed_out", force=True)
        log.info(
            "tracking_closed",
            run_id=self._run_id,
            dropped=self._dropped,
            skipped_duplicates=self._skipped_duplicates,
        )

    def _put(self, item: _Item) -> None:
        if self._closed:
            self._count_drop(_size(item), "after_close")
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._count_drop(_size(item), "queue_full")

    def _count_drop(self, n: int, reason: str, *, error: str | None = None, force: bool = False) -> None:
        if n <= 0:
            return
        with self._lock:
            if self._abandon.is_set() and not force:
                return  # close() already counted everything the sender held
            self._dropped += n
            now = time.monotonic()
            warn = force or now - self._last_drop_warning >= self._warn_interval
            if warn:
                self._last_drop_warning = now
        if warn:
            log.warning(
                "tracking_points_dropped",
                reason=reason,
                dropped_total=self._dropped,
                error=error,
                tracking_uri=self.tracking_uri,
            )

    def _drain_uncounted(self) -> int:
        n = 0
        while True:
            try:
                n += _size(self._queue.get_nowait())
            except queue.Empty:
                return n

    # ------------------------------------------------------------------------------ sender thread
    def _run(self) -> None:
        try:
            backend = self._backend_factory()
            opened = self._open(backend)
            if opened is None:  # closing before the store was reachable
                self._count_drop(self._drain_uncounted(), "store_unreachable", force=True)
                return
            if opened.resumed:
                self._backfill(backend, opened)
            self._send_loop(backend, opened)
            if not self._abandon.is_set() and self._final_status is not None:
                try:
                    backend.finish(opened.run_id, self._final_status)
                except Exception as e:
                    log.warning("tracking_finish_failed", run_id=opened.run_id, error=one_line(e))
        except Exception as e:  # a bug must not take the worker down; say so loudly
            log.error("tracking_sender_crashed", error=one_line(e), exc_info=True)
            self._count_drop(self._drain_uncounted(), "sender_crashed", force=True)

    def _open(self, backend: TrackingBackend) -> OpenedRun | None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        existing = read_run_id(self.run_dir)
        delay = self._backoff_min
        while True:
            try:
                opened = backend.open_run(
                    existing_run_id=existing,
                    job=self.job,
                    run_dir=str(self.run_dir.resolve()),
                    experiment=self.experiment,
                )
                break
            except Exception as e:
                log.warning(
                    "tracking_open_failed", tracking_uri=self.tracking_uri, error=one_line(e), retry_in_seconds=delay
                )
                if self._closing.wait(delay):
                    return None
                delay = min(delay * 2, self._backoff_max)
        if opened.run_id != existing:
            try:
                write_atomic(self.run_dir / layout.MLFLOW_RUN_ID, opened.run_id + "\n")
                box = current_outbox()  # elastic.outputs: etcd: the launcher's run_dir gets it too
                if box is not None:
                    box.append(layout.MLFLOW_RUN_ID, (opened.run_id + "\n").encode())
            except OSError as e:
                log.warning("tracking_run_id_not_saved", path=str(self.run_dir / layout.MLFLOW_RUN_ID), error=str(e))
        self._run_id = opened.run_id
        self._started.set()
        log.info(
            "tracking_run_opened",
            run_id=opened.run_id,
            resumed=opened.resumed,
            tracking_uri=self.tracking_uri,
            metrics_with_history=len(opened.high_water),
        )
        return opened

    def _backfill(self, backend: TrackingBackend, opened: OpenedRun) -> None:
        """Send the run log's points above the store's high-water marks, once; raise the marks past them."""
        try:
            events = read_events(self.run_dir / layout.EVENTS, on_skip=lambda line, reason: None)
        except OSError:  # no run log yet (or unreadable): nothing to fill in
            return
        points = backfill_points(events, opened.high_water)  # marks rise even if a request fails: never twice
        size = MAX_METRICS_PER_BATCH - MAX_PARAMS_TAGS_PER_BATCH
        sent = 0
        for i in range(0, len(points), size):
            chunk = points[i : i + size]
            if self._abandon.is_set():  # close() gave up waiting
                self._count_drop(len(points) - i, "backfill_abandoned", force=True)
                break
            if not self._send(backend, opened.run_id, _Batch(metrics=chunk)):  # counts the chunk's drops
                self._count_drop(len(points) - i - len(chunk), "backfill_stopped")
                break
            sent += len(chunk)
        self._backfilled = sent
        if points:
            log.info("tracking_backfilled", run_id=opened.run_id, points=sent, of=len(points))

    def _send_loop(self, backend: TrackingBackend, opened: OpenedRun) -> None:
        high_water = dict(opened.high_water)
        params_sent = dict(opened.params)
        delay = self._backoff_min
        while not self._abandon.is_set():
            try:
                first = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            items = [first]
            while not isinstance(items[-1], _Artifact) and len(items) < MAX_METRICS_PER_BATCH:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            batches = _batches(items, high_water, params_sent, self._note_duplicates)
            with self._lock:
                if self._abandon.is_set():  # close gave up meanwhile and counted the queue; count these
                    self._dropped += sum(_size_of(b) for b in batches)
                    return
                self._in_flight = sum(_size_of(b) for b in batches)
            ok = True
            for batch in batches:
                if ok and not self._abandon.is_set():
                    ok = self._send(backend, opened.run_id, batch)
                else:  # the store just failed (or close gave up): don't spend another timeout on it
                    self._count_drop(_size_of(batch), "request_failed")
                with self._lock:
                    self._in_flight -= _size_of(batch)
            if ok:
                delay = self._backoff_min
                if self._flush_interval > 0:  # let the next points gather into one request (close cuts it short)
                    self._closing.wait(self._flush_interval)
            elif not self._closing.is_set():  # let the store recover; the queue buffers meanwhile
                self._abandon.wait(delay)
                delay = min(delay * 2, self._backoff_max)

    def _note_duplicates(self, n: int) -> None:
        with self._lock:
            self._skipped_duplicates += n

    def _send(self, backend: TrackingBackend, run_id: str, batch: _Batch | _Artifact) -> bool:
        try:
            if isinstance(batch, _Artifact):
                backend.log_artifact(run_id, batch.path, batch.artifact_path)
            elif batch.size:
                backend.log_batch(run_id, batch.metrics, batch.params, batch.tags)
            return True
        except Exception as e:
            self._count_drop(_size_of(batch), "request_failed", error=one_line(e))
            return False


@dataclass(slots=True)
class _Batch:
    metrics: list[MetricPoint] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.metrics) + len(self.params) + len(self.tags)

    def full(self) -> bool:
        return (
            len(self.metrics) >= MAX_METRICS_PER_BATCH - MAX_PARAMS_TAGS_PER_BATCH
            or len(self.params) >= MAX_PARAMS_TAGS_PER_BATCH
            or len(self.tags) >= MAX_PARAMS_TAGS_PER_BATCH
        )


def _size_of(batch: _Batch | _Artifact) -> int:
    return 1 if isinstance(batch, _Artifact) else batch.size


def _batches(
    items: list[_Item],
    high_water: dict[str, int],
    params_sent: dict[str, str],
    note_duplicates: Callable[[int], None],
) -> list[_Batch | _Artifact]:
    """Turn queued items into requests in order, applying the high-water marks and the params rule.

    ``high_water`` and ``params_sent`` are updated as if every request succeeds: a point whose request
    fails may have reached the store anyway, so it is never sent twice.
    """
    out: list[_Batch | _Artifact] = []
    batch = _Batch()

    def flush() -> None:
        nonlocal batch
        if batch.size:
            out.append(batch)
        batch = _Batch()

    for item in items:
        if isinstance(item, _Artifact):
            flush()
            out.append(item)
            continue
        if isinstance(item, _Metrics):
            skipped = 0
            for key, number in item.values.items():
                if item.step <= high_water.get(key, -1):
                    skipped += 1
                    continue
                high_water[key] = item.step
                batch.metrics.append(MetricPoint(key, number, item.timestamp_ms, item.step))
                if batch.full():
                    flush()
            if skipped:
                note_duplicates(skipped)
        elif isinstance(item, _Params):
            for key, text in item.values.items():
                old = params_sent.get(key)
                if old == text:
                    continue
                if old is None:
                    params_sent[key] = text
                    batch.params[key] = text
                else:  # MLflow params are immutable: keep the first value, record the change as a tag
                    batch.tags[f"elastictrain.param_changed.{key}"] = f"{old} -> {text}"[:MAX_TAG_VALUE_LENGTH]
                if batch.full():
                    flush()
        else:
            for key, text in item.values.items():
                batch.tags[key] = text
                if batch.full():
                    flush()
    flush()
    return out


def make_tracker(cfg: JobConfig, rank: int, env: Mapping[str, str] | None = None) -> Tracker:
    """The worker's tracker: MLflow on rank 0 when ``tracking.mlflow`` is on, else a :class:`NullTracker`."""
    if rank != 0 or not cfg.tracking.mlflow:
        return NullTracker()
    return MlflowTracker(
        run_dir=cfg.run_path,
        job=cfg.job,
        experiment=cfg.tracking.experiment,
        tracking_uri=resolve_tracking_uri(cfg.tracking.tracking_uri, cfg.run_path, env),
        queue_size=cfg.tracking.queue_size,
        flush_interval_seconds=cfg.tracking.flush_seconds,
    )


__all__ = [
    "MetricPoint",
    "MlflowBackend",
    "MlflowTracker",
    "NullTracker",
    "OpenedRun",
    "Tracker",
    "TrackingBackend",
    "make_tracker",
    "read_run_id",
    "resolve_tracking_uri",
]
