"""End to end: horovodrun discovers hosts through discover.sh while agents join and drain.

Three logical hosts that horovodrun runs locally (``localhost``, ``127.0.0.1`` and this machine's
hostname) each get an agent. Two agents start the job at size 2; a third agent grows it to 3; SIGTERM
to that agent drains it and Horovod shrinks the job back to 2 without rolling back a step.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.etcd import EtcdServer
from tests.fixtures.procs import REPO, VENV_BIN, ProcessGroup, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

HOROVODRUN = VENV_BIN / "horovodrun"
WORKER = REPO / "tests" / "integration" / "workers" / "elastic_recorder.py"
JOB = "e2e"


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def current_size(path: Path) -> int | None:
    recs = records(path)
    return recs[-1]["size"] if recs else None


@pytest.mark.skipif(not HOROVODRUN.exists(), reason="horovodrun is not installed in .venv")
def test_agents_grow_and_gracefully_shrink_a_horovodrun_job(
    etcd_server: EtcdServer, procs: ProcessGroup, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}",
        "ELASTICTRAIN_ETCD": etcd_server.endpoint,
        "ELASTICTRAIN_JOB": JOB,
        "ELASTICTRAIN_DISCOVER_CACHE": str(tmp_path / "discover-cache.json"),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "20",
        "ELASTICTRAIN_LOG_LEVEL": "warning",
    }
    log = (tmp_path / "processes.log").open("ab")

    def agent(host: str) -> subprocess.Popen:
        return procs.start(
            [str(VENV_BIN / "elastictrain"), "agent", "--etcd", etcd_server.endpoint, "--job", JOB, "--host", host,
             "--slots", "1", "--ttl", "3", "--heartbeat", "0.5", "--request-timeout", "0.5", "--drain-grace", "10"],
            env=env, stdout=log, stderr=log,
        )  # fmt: skip

    def discovered() -> str:
        out = subprocess.run([str(REPO / "discovery" / "discover.sh")], env=env, capture_output=True, text=True,
                             timeout=10, check=False)  # fmt: skip
        return out.stdout

    agent("localhost")
    agent("127.0.0.1")
    wait_until(lambda: discovered() == "127.0.0.1:1\nlocalhost:1\n", 20, what="two hosts discovered")

    record_file, stop_file = tmp_path / "sizes.jsonl", tmp_path / "stop"
    horovodrun = procs.start(
        [str(HOROVODRUN), "-np", "2", "--min-np", "2", "--max-np", "3",
         "--host-discovery-script", str(REPO / "discovery" / "discover.sh"),
         "--network-interfaces", "lo", "--blacklist-cooldown-range", "1", "2", "--elastic-timeout", "60",
         str(VENV_BIN / "python"), str(WORKER), str(record_file), str(stop_file)],
        env=env, stdout=log, stderr=log, cwd=tmp_path,
    )  # fmt: skip
    wait_until(lambda: current_size(record_file) == 2, 90, interval=0.2, what="job running at size 2")

    third = agent(socket.gethostname())
    wait_until(lambda: current_size(record_file) == 3, 90, interval=0.2, what="job grown to size 3")

    third.send_signal(signal.SIGTERM)
    wait_until(lambda: current_size(record_file) == 2, 60, interval=0.2, what="job shrunk back to size 2")
    steps_at_two = len(records(record_file))
    wait_until(lambda: len(records(record_file)) >= steps_at_two + 3, 30, what="steps at size 2 after the drain")

    stop_file.touch()
    assert horovodrun.wait(timeout=60) == 0, (tmp_path / "processes.log").read_text()[-3000:]
    assert third.wait(timeout=15) == 0, "the drained agent exits 0 after its grace period"

    recs = records(record_file)
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), f"a step was rolled back or repeated: {steps}"
    sizes = [r["size"] for r in recs]
    collapsed = [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s]
    assert collapsed == [2, 3, 2], f"world sizes over time: {collapsed}"
