"""The workers' records reach the launcher's run_dir through etcd (``elastic.outputs: etcd``): the outbox and the
collector on a real etcd, through a restart of it; then a real job under ``elastictrain launch`` whose rank 0 is
SIGKILLed, with every sample once in the ledger the launcher wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from chaos import faults
from chaos.jobs import LaunchedJob
from chaos.procs import wait_until
from discovery.kv import EtcdKeyValue
from elastictrain.errors import ScenarioError
from elastictrain.rundir import layout
from elastictrain.rundir.events import Done, Reset, of_kind
from elastictrain.rundir.outbox import Collector, Outbox, outbox_prefix
from tests.fixtures.elastic_job import assert_exactly_once, job_config
from tests.fixtures.etcd import EtcdServer

pytestmark = pytest.mark.integration


def test_records_of_two_writers_cross_a_restart_of_etcd_once_each(etcd_server: EtcdServer, tmp_path: Path) -> None:
    prefix = outbox_prefix("/elastictrain", "outbox-itest")
    stores = [EtcdKeyValue(etcd_server.endpoint, "outbox-itest", timeout_seconds=1.0) for _ in range(3)]
    a, b = Outbox(stores[0], prefix, "a.1.1"), Outbox(stores[1], prefix, "b.2.2")
    collector = Collector(stores[2], prefix, tmp_path)
    try:
        for n in range(100):
            (a if n % 2 else b).append(layout.EVENTS, json.dumps({"n": n}).encode() + b"\n")
        assert a.flush(20) and b.flush(20)
        collector.collect()
        etcd_server.stop()
        for n in range(100, 150):
            a.append(layout.EVENTS, json.dumps({"n": n}).encode() + b"\n")
        assert not a.flush(0.5), "etcd is down"
        etcd_server.start()  # same ports and data dir: the chunks already put are still there
        assert a.flush(30)
        wait_until(
            lambda: collector.collect() == 0 and not stores[2].get_prefix(prefix, 10), 30, what="an empty outbox"
        )
        numbers = [json.loads(line)["n"] for line in (tmp_path / layout.EVENTS).read_text().splitlines()]
        assert sorted(numbers) == list(range(150)), "every record once"
        assert numbers[100:] == list(range(100, 150)), "one writer's records in its order"
    finally:
        a.close(timeout=1), b.close(timeout=1)
        for s in stores:
            s.close()


@pytest.mark.long  # make test's share-nothing chaos test runs the same (rank 0's node killed, outputs through etcd)
def test_a_job_whose_workers_write_through_etcd_keeps_every_sample_once_when_rank_0_is_killed(tmp_path: Path) -> None:
    cfg = job_config(
        tmp_path / "run",
        job=f"outbox-{os.urandom(3).hex()}",
        training__epochs=1,
        elastic__outputs="etcd",
        elastic__signals="etcd",
        elastic__min_np=2,
    )
    run = LaunchedJob(tmp_path / "run", cfg)
    try:
        run.start()
        run.wait_step(20)
        first_rank0 = run.job().rank0()
        assert first_rank0 is not None
        kill = faults.kill_worker(run.job(), run.log, rank=0)
        run.wait_for(
            lambda: any(e.reason == "worker_failed" for e in of_kind(run.events(), Reset) if e.ts > kill["ts"]),
            90,
            "the recovery after rank 0's SIGKILL",
        )
        code = run.wait_exit(300)
    except ScenarioError as e:
        pytest.fail(f"{e}; launch log: {(run.run_dir / 'launch.log').read_text()[-3000:]}")
    finally:
        leftovers = run.close()
    assert code == 0 and not leftovers
    assert of_kind(run.events(), Done), "the run log the launcher wrote ends with done"
    state = json.loads((run.run_dir / layout.OUTBOX_STATE).read_text())
    assert len(state["writers"]) >= 2, f"rank 0 moved, so two writers at least: {state['writers']}"
    tenures = sorted(p.name for p in (run.run_dir / layout.LEDGER).iterdir())
    assert len(tenures) >= 2 and all(n.startswith("tenure-") for n in tenures), tenures
    assert_exactly_once(run, cfg["data"]["num_samples"], cfg["training"]["epochs"])


def test_the_embedded_etcd_compacts_its_history(tmp_path: Path) -> None:
    """The outbox and the beats write and delete keys all the time: the launcher's etcd runs with revision
    auto-compaction (its history would otherwise fill etcd's quota), and this etcd takes the flags and serves."""
    from elastictrain.launcher.etcd import COMPACTION_RETENTION_REVISIONS, EtcdServer

    server = EtcdServer(tmp_path / "data", tmp_path / "etcd.log")
    cmd = server.command()
    assert cmd[cmd.index("--auto-compaction-mode") + 1] == "revision"
    assert int(cmd[cmd.index("--auto-compaction-retention") + 1]) == COMPACTION_RETENTION_REVISIONS
    server.start()
    try:
        store = EtcdKeyValue(server.endpoint, "compaction", timeout_seconds=2.0)
        try:
            store.put("/elastictrain/compaction/k", b"v")
            assert store.get_prefix("/elastictrain/compaction/", 10)[0][1] == b"v", "etcd takes the flags and serves"
        finally:
            store.close()
    finally:
        server.kill()
