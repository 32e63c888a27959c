"""``elastictrain status --etcd --job`` against a real etcd: the registered hosts are listed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from discovery.record import HostRecord
from discovery.registry import EtcdRegistry
from elastictrain.tools.status import main
from tests.fixtures.etcd import EtcdServer

pytestmark = pytest.mark.integration


def test_status_lists_the_hosts_registered_in_etcd(
    tmp_path: Path, etcd_server: EtcdServer, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text(
        json.dumps({"ts": 1.0, "event": "start", "step": 0, "epoch": 0, "world_size": 2, "hosts": ["h1", "h2"]}) + "\n"
    )
    with EtcdRegistry(etcd_server.endpoint, "job1") as registry:
        lease = registry.grant_lease(30)
        for host in ("h1", "h2"):
            assert registry.register(HostRecord(host=host, slots=1, addr="127.0.0.1"), lease)
        argv = ["--run-dir", str(run_dir), "--json", "--etcd", etcd_server.endpoint, "--job", "job1"]
        assert main(argv) == 0
        registry.revoke_lease(lease)
    st = json.loads(capsys.readouterr().out)
    assert [(h["host"], h["slots"], h["state"]) for h in st["registered_hosts"]] == [
        ("h1", 1, "ready"),
        ("h2", 1, "ready"),
    ]

    etcd_server.kill()
    assert main(argv) == 1  # etcd gone: the rest is shown, the error named
    assert "registered_hosts_error" in json.loads(capsys.readouterr().out)
