"""The just-in-time checkpoint of a preemption notice, end to end: a real job under ``elastictrain launch`` (embedded
etcd, its agents, horovodrun, two workers) whose every host gets a notice in its etcd record (written through the
registry as the agent writes it); rank 0 checkpoints the last commit before the notices' end, the machines then go
away (agents and workers SIGKILLed), new agents register, and the job's new workers resume from that checkpoint with
no committed step lost. Prints notice -> checkpoint durable (seconds); with ``ballast_mib`` the model carries a buffer
of that size, so the checkpoint holds that much state more.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
import yaml

from discovery.registry import EtcdRegistry
from elastictrain.launcher.processes import is_worker
from elastictrain.rundir.events import Checkpoint, Commit, Done, PreemptionCheckpoint, Start, of_kind
from tests.fixtures.launch import (
    HOSTS,
    Launch,
    events,
    job_processes,
    launch_state,
    needs_horovod,
    start_agents,
)
from tests.fixtures.procs import ProcessGroup, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

NOTICE_SECONDS = 30.0
"""GCP's warning: the notices' end is this far after they are written."""

BALLAST_TASK = """
import torch
from elastictrain.tasks.image import build as image_build


def build(ballast_mib: int = 0, **kwargs):
    task = image_build(**kwargs)
    if ballast_mib:  # state that is checkpointed but never allreduced: a model buffer
        task.model.register_buffer("ballast", torch.ones(ballast_mib * 2**20 // 4))
    return task
"""


def write_config(tmp_path: Path, job: str, *, max_steps: int, ballast_mib: int, location: str | None) -> Path:
    (tmp_path / "ballast.py").write_text(BALLAST_TASK)
    cfg = {
        "job": job,
        "run_dir": str(tmp_path / "run"),
        "device": "cpu",
        "task": "ballast:build",
        "task_args": {
            "ballast_mib": ballast_mib,
            "model": "small_cnn",
            "num_classes": 10,
            "image_size": 16,
            "num_samples": 32 * (max_steps + 10),
            "num_val_samples": 64,
            "augment": False,
        },
        "data": {"batch_size": 16},
        "training": {"epochs": 1, "max_steps": max_steps, "base_lr": 0.05, "log_every_steps": 5},
        "elastic": {"commit_every_steps": 5, "min_np": 2, "max_np": 2, "base_world_size": 2},
        # No periodic checkpoint: the only checkpoints of the first attempt are the notice's.
        "checkpoint": {"every_steps": None, "every_epochs": None, "keep_last": 2}
        | ({"location": location} if location else {}),
        "tracking": {"mlflow": False, "progress_bar": False},
        "discovery": {"ttl_seconds": 3, "heartbeat_seconds": 0.5},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def give_every_host_a_notice(etcd: str, job: str, until: float) -> list[str]:
    """What each host's agent writes on a notice: the host draining, the notice and its end in the record."""
    noticed = []
    with EtcdRegistry(etcd, job) as registry:
        for entry in registry.list_hosts().entries:
            assert registry.compare_and_set(entry, entry.record.with_notice("gcp-preempted", until))
            noticed.append(entry.record.host)
    return noticed


@needs_horovod
@pytest.mark.parametrize(
    ("ballast_mib", "store"),
    [
        (0, "local"),
        # The 100-MiB cases measure the goal (a 100 MiB state durable <= 10 s after the notice): `make test-long`.
        pytest.param(100, "local", marks=pytest.mark.long),
        pytest.param(100, "s3", marks=pytest.mark.long),
    ],
    ids=["small", "100MiB", "100MiB-s3"],
)
def test_notices_on_every_host_checkpoint_the_last_commit_in_time_and_the_relaunch_loses_no_committed_step(
    procs: ProcessGroup,
    tmp_path: Path,
    no_leftovers: list[Launch],
    request: pytest.FixtureRequest,
    ballast_mib: int,
    store: str,
) -> None:
    steps = 400
    # s3: checkpoints in a real S3 API server on loopback (moto's; the fixture sets the AWS chain's variables, which
    # the launcher and its workers inherit).
    location = request.getfixturevalue("s3_server").url("checkpoints") if store == "s3" else None
    config = write_config(tmp_path, f"jit-{ballast_mib}", max_steps=steps, ballast_mib=ballast_mib, location=location)
    launch = Launch(procs, config, tmp_path, "--wait-hosts-seconds", "90", "--gloo-timeout-seconds", "60")
    no_leftovers.append(launch)
    run_dir = launch.run_dir

    def committed() -> int:
        return max((e.step for e in of_kind(events(run_dir), Commit)), default=0)

    wait_until(lambda: committed() >= 20, 180, interval=0.1, what=f"20 committed steps; log: {launch.log()}")
    state = launch_state(run_dir)
    assert state is not None

    t0 = time.time()
    deadline = t0 + NOTICE_SECONDS
    assert sorted(give_every_host_a_notice(state["etcd"], state["job"], deadline)) == sorted(HOSTS.split(","))

    def durable_jit() -> Checkpoint | None:
        evs = events(run_dir)
        jit = {e.step for e in of_kind(evs, PreemptionCheckpoint)}
        saved = [c for c in of_kind(evs, Checkpoint) if c.step in jit]
        return saved[-1] if saved else None

    first = wait_until(durable_jit, NOTICE_SECONDS, interval=0.05, what=f"a just-in-time checkpoint; {launch.log()}")
    assert first is not None
    notice_to_durable = first.ts - t0
    # The workers stop committing once Horovod removes the drained hosts (they wait in the reset's rendezvous):
    # the last commit is then the last checkpoint.
    wait_until(
        lambda: (c := durable_jit()) is not None and c.step == committed(),
        max(1.0, deadline - time.time()),
        interval=0.1,
        what="the last commit checkpointed before the notices' end",
    )
    last_commit = committed()
    assert time.time() < deadline

    # The notices' end: every machine goes away, agents and workers at once.
    victims = [psutil.Process(pid) for pid in state["agents"].values()]
    victims += [p for p in job_processes(state["launch_id"]) if is_worker(p)]
    for v in victims:
        v.kill()
    lost_at_kill = committed() - last_commit

    # New machines under the same names, with fresh records (no notice): horovodrun, which waits for hosts since the
    # drain, starts workers on them (or, once it gave up, the launcher relaunches it); either resumes from the store.
    start_agents(procs, state, tmp_path / "agents.log")
    assert launch.wait(timeout=180) == 0, launch.log()

    evs = events(run_dir)
    starts = of_kind(evs, Start)
    assert len(starts) == 2 and starts[0].resumed_from_step is None, starts
    assert lost_at_kill == 0, "a commit came after the last just-in-time checkpoint"
    assert starts[1].resumed_from_step == last_commit == starts[1].step, "committed steps lost"
    assert [e.step for e in of_kind(evs, Done)] == [steps]
    jit = of_kind(evs, PreemptionCheckpoint)
    assert jit and all(e.deadline == pytest.approx(deadline) for e in jit)
    print(
        f"\nballast {ballast_mib} MiB, {store}: notice -> checkpoint durable {notice_to_durable:.2f} s "
        f"(step {first.step}, {len(jit)} just-in-time save(s), last commit {last_commit})"
    )
