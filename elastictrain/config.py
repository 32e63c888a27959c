"""Typed job configuration: YAML parsed once into frozen, keyword-only dataclasses.

Each component owns one dataclass and receives only its own part. Parsing is strict: unknown keys are
rejected with their dotted path and the closest valid name, types and ranges are checked, and every
error is a :class:`ConfigError` whose message is one line. ``--set a.b=c`` overrides any field; the
value is parsed as YAML (``--set training.base_lr=0.05``, ``--set data.path=null``).

Size: every config section and its one parser (docs/decisions.md).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from discovery.wire import check_name
from elastictrain.checkpoint.location import location_problem
from elastictrain.errors import ConfigError as ConfigError

DEFAULT_TASK = "elastictrain.tasks.image:build"
"""The task of a config without ``task``: the built-in image classifier (:mod:`elastictrain.tasks.image`)."""
IMAGE_TASK_KEYS = {
    "model.name": "model",
    "model.num_classes": "num_classes",
    "model.channels_last": "channels_last",
    "data.kind": "data",
    "data.path": "path",
    "data.val_path": "val_path",
    "data.image_size": "image_size",
    "data.num_samples": "num_samples",
    "data.num_val_samples": "num_val_samples",
    "data.augment": "augment",
    "training.label_smoothing": "label_smoothing",
}
"""Keys of the built-in image task that configs wrote before the Task API -> their name in ``task_args``."""


def _check(cond: bool, path: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{path}: {msg}")


@dataclass(kw_only=True, frozen=True, slots=True)
class DataConfig:
    """How the engine feeds the task's data (what the data is belongs to the task: ``task_args``)."""

    batch_size: int = 32
    """Samples per worker per step under the ``per_worker`` policy (ignored by ``global``)."""
    loader_workers: int = 0
    """DataLoader worker processes per training process."""
    drop_last: bool = False
    """Drop the final short step of an epoch (otherwise it runs with fewer samples; no sample is padded)."""

    def __post_init__(self) -> None:
        _check(self.batch_size >= 1, "data.batch_size", f"must be >= 1, got {self.batch_size}")
        _check(self.loader_workers >= 0, "data.loader_workers", f"must be >= 0, got {self.loader_workers}")


@dataclass(kw_only=True, frozen=True, slots=True)
class ScheduleConfig:
    kind: Literal["constant", "multistep", "cosine"] = "constant"
    """LR schedule after warm-up, stepped once per optimizer step."""
    milestones: tuple[int, ...] = ()
    """Epochs at which ``multistep`` multiplies the LR by ``gamma``."""
    gamma: float = 0.1
    """Decay factor of ``multistep``."""
    warmup_epochs: float = 0.0
    """Linear warm-up from ``base_lr / 10`` over this many epochs (fractions allowed)."""
    min_lr_ratio: float = 0.0
    """Floor of ``cosine`` as a fraction of the peak LR."""

    def __post_init__(self) -> None:
        _check(0.0 < self.gamma <= 1.0, "training.schedule.gamma", f"must be in (0, 1], got {self.gamma}")
        _check(
            self.warmup_epochs >= 0,
            "training.schedule.warmup_epochs",
            f"must be >= 0, got {self.warmup_epochs}",
        )
        _check(0.0 <= self.min_lr_ratio <= 1.0, "training.schedule.min_lr_ratio", "must be in [0, 1]")
        _check(
            list(self.milestones) == sorted(set(self.milestones)),
            "training.schedule.milestones",
            f"must be strictly increasing, got {list(self.milestones)}",
        )
        _check(all(m > 0 for m in self.milestones), "training.schedule.milestones", "must be positive epochs")
        if self.kind == "multistep":
            _check(len(self.milestones) > 0, "training.schedule.milestones", "must not be empty for multistep")


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainingConfig:
    epochs: int = 1
    """Passes over the training set."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in all (for smoke runs); none means run all epochs."""
    optimizer: Literal["sgd", "adamw"] = "sgd"
    """The optimizer a task without its own ``optimizer`` factory gets, built from the ``training`` keys."""
    base_lr: float = 0.1
    """LR at ``elastic.base_world_size`` workers (``per_worker``) or for the whole global batch (``global``)."""
    momentum: float = 0.9
    """SGD momentum (AdamW ignores it)."""
    weight_decay: float = 1e-4
    """Weight decay of the optimizer."""
    nesterov: bool = False
    """Nesterov momentum (SGD; AdamW ignores it)."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    grad_clip_norm: float | None = None
    """Clip the averaged gradients to this L2 norm (applied after ``optimizer.synchronize()``)."""
    grad_accumulation: int = 1
    """Backward passes per optimizer step (Horovod's ``backward_passes_per_step``)."""
    seed: int = 0
    """Seed of model init, data order and augmentation."""
    log_every_steps: int = 10
    """Steps between metric logs (the only steps that call ``.item()`` or a metric collective)."""

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, "training.epochs", f"must be >= 1, got {self.epochs}")
        if self.max_steps is not None:
            _check(self.max_steps >= 1, "training.max_steps", f"must be >= 1, got {self.max_steps}")
        _check(self.base_lr > 0, "training.base_lr", f"must be > 0, got {self.base_lr}")
        _check(0.0 <= self.momentum < 1.0, "training.momentum", f"must be in [0, 1), got {self.momentum}")
        _check(self.weight_decay >= 0, "training.weight_decay", f"must be >= 0, got {self.weight_decay}")
        if self.grad_clip_norm is not None:
            _check(self.grad_clip_norm > 0, "training.grad_clip_norm", f"must be > 0, got {self.grad_clip_norm}")
        _check(
            self.grad_accumulation >= 1,
            "training.grad_accumulation",
            f"must be >= 1, got {self.grad_accumulation}",
        )
        _check(self.log_every_steps >= 1, "training.log_every_steps", f"must be >= 1, got {self.log_every_steps}")


@dataclass(kw_only=True, frozen=True, slots=True)
class PrecisionConfig:
    mode: Literal["fp32", "fp16", "bf16"] = "fp32"
    """``fp16``: autocast + GradScaler on CUDA (bf16 autocast on CPU, where fp16 autocast is not supported);
    ``bf16``: bf16 autocast."""


@dataclass(kw_only=True, frozen=True, slots=True)
class CompressionConfig:
    gradients: Literal["none", "fp16"] = "none"
    """Compression of gradients on the wire (Horovod compressor). Horovod 0.28.1's PyTorch ops reject
    bfloat16 tensors ("Tensor type torch.BFloat16Tensor is not supported"), so there is no ``bf16``."""


FIRST_STEP_HANG_SECONDS = 1800.0
"""The default of ``elastic.first_step_hang_seconds`` (also the hang detector's when it is built without a config)."""


def etcd_transport(key: str, choice: str, environ: Mapping[str, str]) -> str:
    """``files`` or ``etcd`` for a transport setting ``key`` (``auto``, ``files`` or ``etcd``) in a worker whose
    environment is ``environ`` (``ELASTICTRAIN_ETCD`` names the job's etcd, as ``launch`` sets it). Raises
    :class:`ConfigError` for ``etcd`` without an endpoint, or an unknown choice."""
    from elastictrain import envnames

    has_etcd = bool(environ.get(envnames.ETCD, "").strip())
    if choice not in ("auto", "files", "etcd"):
        raise ConfigError(f"{key} must be one of auto, files, etcd, got {choice!r}")
    if choice == "etcd" and not has_etcd:
        raise ConfigError(f"{key} is etcd but {envnames.ETCD} is not set (run under elastictrain launch)")
    return "etcd" if choice == "etcd" or (choice == "auto" and has_etcd) else "files"


@dataclass(kw_only=True, frozen=True, slots=True)
class ElasticConfig:
    policy: Literal["per_worker", "global"] = "per_worker"
    """``per_worker``: global batch = workers x per-worker batch, LR rescaled on resize;
    ``global``: fixed global batch split over workers, LR unchanged."""
    base_world_size: int = 1
    """World size at which ``training.base_lr`` applies (``per_worker``)."""
    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    """How the LR follows the world size under ``per_worker``."""
    lr_ramp_steps: int = 0
    """Steps over which the LR moves to its new value after a resize (0: at once)."""
    global_batch_size: int | None = None
    """Samples per optimizer step under ``global``; required there."""
    micro_batch_size: int = 32
    """Largest per-worker forward pass under ``global``; a larger share is split into accumulation steps."""
    commit_every_steps: int = 10
    """Steps between commits: the sample ledger is written, host changes are checked, checkpoints may be
    taken; with ``rollback: commit`` also the in-memory copy a hard failure rolls back to."""
    rollback: Literal["commit", "none"] = "none"
    """What a hard failure (a worker killed mid-step) costs. ``commit``: every rank rolls back to its last
    commit, a copy of the whole state taken every ``commit_every_steps``. ``none``: no copy is kept; the
    failed step's gradients are dropped and everything else is kept, so no step is rolled back (a rank that
    completed the failed step hands it to the others at the sync)."""
    min_np: int = 1
    """Fewest workers to train with (horovodrun ``--min-np``)."""
    max_np: int = 32
    """Most workers to train with (horovodrun ``--max-np``)."""
    stragglers: Literal["off", "report", "evict", "balance"] = "report"
    """What rank 0 does about a slow host (:mod:`elastictrain.engine.health.stragglers`). ``report``: a ``straggler``
    event when a
    host's median compute time per step is ``slow_ratio`` x the others' over ``window_steps``; ``evict``: also drain
    it (as a spot notice, no step lost) when the job is predicted faster without it, for a cool-down; ``balance``:
    each host's share of a step follows its measured speed (:mod:`elastictrain.engine.health.shares`), and a slow
    host is drained as with ``evict`` only when even its smallest share would hold the others back; ``off``:
    nothing is measured."""
    slow_ratio: float = 1.3
    """A host is slow when its median compute time per step is at least this many times the others' median."""
    window_steps: int = 100
    """Steps in each host's rolling window of compute times (a host is judged once it is filled)."""
    straggler_cooldown_seconds: float = 300.0
    """How long an evicted host stays out (> 0); doubled for each earlier eviction of the same host (probation).
    Straggler drains and hung-host evictions use it; with ``stragglers: report`` or ``off`` no host is drained as a
    straggler."""
    share_halflife_steps: float = 10.0
    """``balance``: half-life of a host's smoothed speed, in steps (> 0): a change of speed is half taken into
    account after this many steps, whatever ``commit_every_steps`` is."""
    share_threshold: float = 0.15
    """``balance``: shares move only when some host's fraction of a step would change by more than this part of
    it, or of an equal fraction when that is larger (>= 0), so that noise does not make them oscillate."""
    share_min_per_worker: int = 1
    """``balance``: samples every worker gets at least per step, so a slow host stays measured (>= 0)."""
    share_max_per_worker: int | None = None
    """``balance``: samples one worker gets at most per step (a slower host's part goes to the faster ones up to
    this); null: no cap. Ignored when the caps cannot hold the global batch."""
    hang_seconds: float | None = None
    """A peer that makes no progress this long while the others wait for it is a failure: it is killed (same
    machine) or its host evicted, and the job continues without it. None: 10 x the typical step, at least 10 s. In the
    first step after a rendezvous a silent peer (no heartbeat: stopped, or its machine hangs) is hung when silent for
    at least this and ``min(60 s, half the Gloo timeout)``, and one that still beats only after
    ``first_step_hang_seconds``. In a rendezvous the bound is at most that minimum."""
    first_step_hang_seconds: float = FIRST_STEP_HANG_SECONDS
    """How long a peer that still beats may stay in its own work of the first step after a rendezvous (loader
    start-up, cudnn autotune, a cold cache: a slow start cannot be told from a stuck one) before it is hung."""
    signals: Literal["auto", "files", "etcd"] = "files"
    """How workers exchange heartbeats, the collective-failure marker and the hung verdict. ``files``: under
    ``run_dir/.elastic/`` (every node must share the run_dir to judge peers on other machines); ``etcd``: under the
    job's prefix in the etcd the launcher names (``ELASTICTRAIN_ETCD``; no shared disk); ``auto``: etcd when the job
    has one, else files."""
    outputs: Literal["auto", "files", "etcd"] = "files"
    """How what the workers write for the launcher (events, the sample ledger, worker errors, the resolved config)
    reaches its run_dir. ``files``: written into ``run_dir`` (shared by every node); ``etcd``: put under the job's
    prefix and written into the launcher's run_dir by the launcher (no shared disk); ``auto``: etcd when the job has
    one, else files."""

    def __post_init__(self) -> None:
        _check(self.base_world_size >= 1, "elastic.base_world_size", f"must be >= 1, got {self.base_world_size}")
        _check(self.lr_ramp_steps >= 0, "elastic.lr_ramp_steps", f"must be >= 0, got {self.lr_ramp_steps}")
        _check(
            self.micro_batch_size >= 1,
            "elastic.micro_batch_size",
            f"must be >= 1, got {self.micro_batch_size}",
        )
        _check(
            self.commit_every_steps >= 1,
            "elastic.commit_every_steps",
            f"must be >= 1, got {self.commit_every_steps}",
        )
        _check(self.min_np >= 1, "elastic.min_np", f"must be >= 1, got {self.min_np}")
        _check(
            self.max_np >= self.min_np,
            "elastic.max_np",
            f"must be >= elastic.min_np ({self.min_np}), got {self.max_np}",
        )
        _check(self.slow_ratio > 1.0, "elastic.slow_ratio", f"must be > 1, got {self.slow_ratio}")
        _check(self.window_steps >= 4, "elastic.window_steps", f"must be >= 4, got {self.window_steps}")
        _check(
            0 < self.share_halflife_steps < math.inf,
            "elastic.share_halflife_steps",
            f"must be > 0 and finite, got {self.share_halflife_steps:g}",
        )
        _check(
            0 <= self.share_threshold < math.inf,
            "elastic.share_threshold",
            f"must be >= 0 and finite, got {self.share_threshold:g}",
        )
        _check(
            self.share_min_per_worker >= 0,
            "elastic.share_min_per_worker",
            f"must be >= 0, got {self.share_min_per_worker}",
        )
        if self.share_max_per_worker is not None:
            _check(
                self.share_max_per_worker >= max(1, self.share_min_per_worker),
                "elastic.share_max_per_worker",
                f"must be >= 1 and >= elastic.share_min_per_worker, or null, got {self.share_max_per_worker}",
            )
        _check(
            0 < self.straggler_cooldown_seconds < math.inf,
            "elastic.straggler_cooldown_seconds",
            f"must be > 0 and finite, got {self.straggler_cooldown_seconds:g}",
        )
        _check(
            60 <= self.first_step_hang_seconds < math.inf,
            "elastic.first_step_hang_seconds",
            f"must be >= 60 and finite, got {self.first_step_hang_seconds:g}",
        )
        if self.hang_seconds is not None:
            _check(self.hang_seconds >= 1, "elastic.hang_seconds", f"must be >= 1 or null, got {self.hang_seconds}")
        if self.policy == "global":
            _check(
                self.global_batch_size is not None,
                "elastic.global_batch_size",
                "is required when elastic.policy is global",
            )
        if self.global_batch_size is not None:
            _check(
                self.global_batch_size >= 1,
                "elastic.global_batch_size",
                f"must be >= 1, got {self.global_batch_size}",
            )


@dataclass(kw_only=True, frozen=True, slots=True)
class CheckpointConfig:
    enabled: bool = True
    """Write checkpoints (to ``checkpoint.location``; by default ``run_dir/checkpoints``)."""
    every_steps: int | None = 100
    """Save every N optimizer steps (at a commit); none disables the step trigger."""
    every_epochs: int | None = 1
    """Save at the end of every N epochs; none disables the epoch trigger."""
    keep_last: int = 3
    """Complete checkpoints to keep; older ones are pruned."""
    writer: Literal["process", "thread", "sync"] = "process"
    """Where serialisation and writing happen: a background process (default), a thread, or inline."""
    save_on_sigterm: bool = True
    """Rank 0 writes the last committed state when a worker receives SIGTERM."""
    resume: bool = True
    """Start from the latest verified checkpoint at ``checkpoint.location`` when one exists."""
    location: str = ""
    """Where checkpoints live: empty for ``run_dir/checkpoints``, a local or shared path (a relative one is under
    run_dir), or an object store (``s3://bucket/prefix``, ``gs://...``, ``az://container/prefix``; needs the
    ``s3``/``gcs``/``azure`` extra).
    Credentials come from the cloud's own chain (environment, profile, instance role), never from here."""

    def __post_init__(self) -> None:
        problem = location_problem(self.location)
        _check(problem is None, "checkpoint.location", problem or "")
        if self.every_steps is not None:
            _check(
                self.every_steps >= 1,
                "checkpoint.every_steps",
                f"must be >= 1 or null, got {self.every_steps}",
            )
        if self.every_epochs is not None:
            _check(
                self.every_epochs >= 1,
                "checkpoint.every_epochs",
                f"must be >= 1 or null, got {self.every_epochs}",
            )
        _check(self.keep_last >= 1, "checkpoint.keep_last", f"must be >= 1, got {self.keep_last}")


@dataclass(kw_only=True, frozen=True, slots=True)
class TrackingConfig:
    mlflow: bool = True
    """Track the run in MLflow (rank 0, from a background sender)."""
    tracking_uri: str | None = None
    """MLflow tracking URI; none means ``MLFLOW_TRACKING_URI`` or else ``sqlite:///<run_dir>/mlflow.db``."""
    experiment: str = "elastictrain"
    """MLflow experiment of the job's run."""
    queue_size: int = 10000
    """Points buffered for the sender; beyond it points are dropped and counted."""
    flush_seconds: float = 5.0
    """Least seconds between two requests to the store: what is logged meanwhile waits in the queue and goes
    as one batch (each request costs the rank-0 process CPU and GIL time; every point still keeps its step).
    0 sends at once."""
    progress_bar: bool = True
    """Show a tqdm bar on rank 0 when stderr is a terminal."""
    open_wait_seconds: float = 30.0
    """At a job's start (not after a reset), rank 0 waits up to this long for the tracking run to open before the
    first step: importing MLflow and creating the store (about 3 CPU seconds) then does not compete with training
    for the GIL and the cores, and the ``start`` event carries the run id. At most half the Gloo timeout (the other
    workers wait in a collective meanwhile). 0: do not wait."""

    def __post_init__(self) -> None:
        _check(self.queue_size >= 1, "tracking.queue_size", f"must be >= 1, got {self.queue_size}")
        _check(
            0 <= self.flush_seconds <= 3600, "tracking.flush_seconds", f"must be in [0, 3600], got {self.flush_seconds}"
        )
        _check(
            0 <= self.open_wait_seconds <= 3600,
            "tracking.open_wait_seconds",
            f"must be in [0, 3600], got {self.open_wait_seconds}",
        )


@dataclass(kw_only=True, frozen=True, slots=True)
class DiscoveryConfig:
    prefix: str = "/elastictrain"
    """Key prefix; hosts live under ``<prefix>/<job>/hosts/<host>``."""
    ttl_seconds: float = 10.0
    """Lease TTL of an agent: a dead agent's host disappears after at most this long."""
    heartbeat_seconds: float = 2.0
    """Interval between lease refreshes."""

    def __post_init__(self) -> None:
        _check(self.prefix.startswith("/"), "discovery.prefix", f"must start with '/', got {self.prefix!r}")
        _check(self.ttl_seconds > 0, "discovery.ttl_seconds", f"must be > 0, got {self.ttl_seconds}")
        _check(
            0 < self.heartbeat_seconds <= self.ttl_seconds / 3,
            "discovery.heartbeat_seconds",
            f"must be in (0, ttl_seconds/3 = {self.ttl_seconds / 3:g}], got {self.heartbeat_seconds}",
        )


@dataclass(kw_only=True, frozen=True, slots=True)
class AuditConfig:
    sample_ledger: bool = False
    """Write the sample ids of every committed step under ``run_dir/ledger/`` (proof of exactly-once data)."""


_NOT_FINGERPRINTED = (
    "run_dir",
    "discovery",
    "tracking",
    "checkpoint.writer",
    "checkpoint.resume",
    "checkpoint.location",
    "data.loader_workers",
)
"""Config keys :meth:`JobConfig.digest` leaves out: runtime endpoints and knobs, not the training."""


@dataclass(kw_only=True, frozen=True, slots=True)
class JobConfig:
    job: str
    """The job's name; also its etcd prefix and MLflow run name."""
    run_dir: str
    """Where checkpoints, events.jsonl, the ledger and the local MLflow store live (shared storage on a cluster)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA when available, else CPU."""
    task: str = DEFAULT_TASK
    """``module:function`` returning an :class:`elastictrain.Task` (imported in every worker, and by launch to check
    it); the default is the built-in image classifier."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task's function: ``build(**task_args)``."""
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)

    def __post_init__(self) -> None:
        try:
            check_name("job", self.job)
        except ValueError as e:
            raise ConfigError(f"job: {e}") from None
        _check(bool(self.run_dir), "run_dir", "must not be empty")
        module, sep, func = self.task.partition(":")
        _check(
            bool(sep and module and func.isidentifier() and all(p.isidentifier() for p in module.split("."))),
            "task",
            f"must be 'module:function' (e.g. mypkg.lm:build), got {self.task!r}",
        )

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def digest(self) -> str:
        """SHA-256 of what defines the training (checkpoint manifests, the ``start`` event).

        The resolved config less where and how the run is hosted: ``run_dir``, the ``discovery`` and
        ``tracking`` sections (etcd endpoints such as the embedded etcd's random port, the MLflow URI),
        ``checkpoint.writer``/``resume``/``location`` and ``data.loader_workers``. Two launches of the
        same training therefore share a fingerprint.
        """
        d = self.to_dict()
        for key in _NOT_FINGERPRINTED:
            *parents, leaf = key.split(".")
            node = d
            for p in parents:
                node = node.get(p, {})
            node.pop(leaf, None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def flat(self) -> dict[str, str]:
        """Dotted key -> string value, e.g. for MLflow params."""
        out: dict[str, str] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = json.dumps(value) if isinstance(value, list | type(None)) else str(value)

        walk("", self.to_dict())
        return out


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [_to_plain(v) for v in obj]
    return obj


# ------------------------------------------------------------------------------------------ parsing
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: must be a mapping of {tp.__name__} fields, got {type(value).__name__}")
        return _build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path}: must be {_type_name(tp)}, got null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, path)
            except ConfigError as e:
                errors.append(e)
        raise (errors[0] if len(errors) == 1 else ConfigError(f"{path}: must be {_type_name(tp)}, got {value!r}"))
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{path}: must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}{extra}")
        return value
    if origin is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{path}: must be a mapping of names to values, got {value!r}")
        return dict(value)
    if origin is tuple:
        (item,) = typing.get_args(tp)[:1]
        if isinstance(value, str) and item is str:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(f"{path}: must be a list of {_type_name(item)}, got {value!r}")
        return tuple(_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: must be a string, got {value!r}")
        return value
    raise AssertionError(f"unsupported config type {tp!r} at {path}")


def _build(cls: Any, data: Mapping[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in fields:
            hint = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            extra = f" (did you mean {(path + '.' if path else '') + hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{dotted}: unknown key{extra}")
        kwargs[key] = _coerce(hints[key], value, dotted)
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{(path + '.' if path else '') + missing[0]}: required key is missing")
    return cls(**kwargs)


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``dotted.key=value`` override in place; the value is parsed as YAML."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {assignment!r}: expected dotted.key=value, e.g. training.base_lr=0.05")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def config_from_dict(data: Mapping[str, Any], overrides: Sequence[str] = ()) -> JobConfig:
    """Build a :class:`JobConfig` from a mapping plus ``--set`` overrides."""
    raw = json.loads(json.dumps(data))  # deep copy, plain types only
    _move_image_task_keys(raw)
    for assignment in overrides:
        apply_override(raw, _image_task_override(assignment, raw.get("task", DEFAULT_TASK)))
    _move_image_task_keys(raw)
    cfg: JobConfig = _build(JobConfig, raw, "")
    return cfg


def build_section(cls: Any, data: Mapping[str, Any], path: str) -> Any:
    """Parse ``data`` into the frozen dataclass ``cls`` with the same strict rules as the job config (unknown keys
    with a did-you-mean, types, ranges); error paths start with ``path`` (e.g. ``task_args``)."""
    return _build(cls, data, path)


def _image_task_override(assignment: str, task: Any) -> str:
    """``--set model.name=x`` -> ``--set task_args.model=x`` for the image task (an override wins over the file)."""
    key, sep, value = assignment.partition("=")
    arg = IMAGE_TASK_KEYS.get(key.strip())
    return f"task_args.{arg}{sep}{value}" if sep and arg and task == DEFAULT_TASK else assignment


def _move_image_task_keys(raw: dict[str, Any]) -> None:
    """Move the built-in image task's keys of configs written before the Task API (``model.name``, ``data.kind``,
    ...) into ``task_args``. With another task they are an error naming the new place."""
    task = raw.get("task", DEFAULT_TASK)
    for dotted, arg in IMAGE_TASK_KEYS.items():
        section, key = dotted.split(".")
        node = raw.get(section)
        if not isinstance(node, dict) or key not in node:
            continue
        if task != DEFAULT_TASK:
            raise ConfigError(
                f"{dotted}: belongs to the built-in image task; task {task} takes its settings in task_args"
            )
        args = raw.get("task_args")
        if args is None:
            args = raw["task_args"] = {}
        if not isinstance(args, dict):
            continue  # reported by the parser
        if arg in args:
            raise ConfigError(f"{dotted}: set twice (also as task_args.{arg}); keep task_args.{arg}")
        args[arg] = node.pop(key)
    model = raw.get("model")
    if isinstance(model, dict):
        for key in model:
            names = [d.split(".")[1] for d in IMAGE_TASK_KEYS if d.startswith("model.")]
            hint = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            extra = f" (did you mean 'model.{hint[0]}'?)" if hint else ""
            raise ConfigError(f"model.{key}: unknown key{extra}")
        del raw["model"]


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> JobConfig:
    """Read a YAML config file, apply overrides, and validate. Raises :class:`ConfigError`."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"{p}: invalid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    return config_from_dict(data, overrides)
