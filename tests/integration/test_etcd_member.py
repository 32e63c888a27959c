"""deploy/k8s/etcd-member.sh against a real 3-member etcd with client and peer TLS (certificates made by
deploy/k8s/etcd-certs.sh): first start, and a member that lost its volume rejoins (removed and added again) and gets
the data back from the others."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from elastictrain.launcher.etcd import ETCD_BIN
from tests.fixtures.procs import REPO, ProcessGroup, free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SCRIPT = REPO / "deploy" / "k8s" / "etcd-member.sh"
CERTS = REPO / "deploy" / "k8s" / "etcd-certs.sh"
ETCDCTL = os.environ.get("ELASTICTRAIN_TEST_ETCDCTL", str(Path(ETCD_BIN).with_name("etcdctl")))
NAMES = ("etcd-0", "etcd-1", "etcd-2")


class Cluster:
    """Three members on loopback: the env the StatefulSet gives the init container, and etcd --config-file."""

    def __init__(self, tmp: Path, pki: Path, procs: ProcessGroup) -> None:
        self.tmp, self.pki, self.procs = tmp, pki, procs
        self.client = {n: f"https://127.0.0.1:{free_port()}" for n in NAMES}
        self.peer = {n: f"https://127.0.0.1:{free_port()}" for n in NAMES}
        self.metrics = {n: f"http://127.0.0.1:{free_port()}" for n in NAMES}
        self.etcd: dict[str, subprocess.Popen] = {}

    def data_dir(self, name: str) -> Path:
        return self.tmp / name / "data"

    def config(self, name: str) -> Path:
        return self.tmp / name / "run" / "etcd.conf.yml"

    def prepare(self, name: str, retry_seconds: int = 60) -> subprocess.CompletedProcess[str]:
        """Run etcd-member.sh for ``name`` as the init container would."""
        env = {
            "ETCD_MEMBER_RETRY_SECONDS": str(retry_seconds),
            "PATH": os.environ.get("PATH", ""),
            "ETCDCTL": ETCDCTL,
            "ETCD_MEMBER_NAME": name,
            "ETCD_MEMBER_CLUSTER": ",".join(f"{n}={self.peer[n]}" for n in NAMES),
            "ETCD_MEMBER_CLIENT_URL": self.client[name],
            "ETCD_MEMBER_ENDPOINTS": ",".join(self.client.values()),
            "ETCD_MEMBER_DATA_DIR": str(self.data_dir(name)),
            "ETCD_MEMBER_CONFIG": str(self.config(name)),
            "ETCD_MEMBER_CA": str(self.pki / "ca.crt"),
            "ETCD_MEMBER_SERVER_CERT": str(self.pki / "server.crt"),
            "ETCD_MEMBER_SERVER_KEY": str(self.pki / "server.key"),
            "ETCD_MEMBER_PEER_CERT": str(self.pki / "peer.crt"),
            "ETCD_MEMBER_PEER_KEY": str(self.pki / "peer.key"),
            "ETCD_MEMBER_LISTEN_CLIENT": self.client[name],
            "ETCD_MEMBER_LISTEN_PEER": self.peer[name],
            "ETCD_MEMBER_LISTEN_METRICS": self.metrics[name],
        }
        return subprocess.run(["sh", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False)

    def start(self, name: str) -> None:
        log = (self.tmp / name / "etcd.log").open("ab")
        with log:
            self.etcd[name] = self.procs.start(
                [ETCD_BIN, "--config-file", str(self.config(name))], stdout=log, stderr=subprocess.STDOUT
            )

    def stop(self, name: str) -> None:
        proc = self.etcd.pop(name)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)

    def healthy(self, name: str) -> bool:
        try:
            with urllib.request.urlopen(f"{self.metrics[name]}/health", timeout=2) as resp:
                return b'"health":"true"' in resp.read()
        except OSError:
            return False

    def ctl(self, *args: str, endpoints: str | None = None) -> str:
        where = endpoints or ",".join(self.client.values())
        cmd = [ETCDCTL, f"--endpoints={where}", f"--cacert={self.pki / 'ca.crt'}", f"--cert={self.pki / 'client.crt'}",
               f"--key={self.pki / 'client.key'}", "--dial-timeout=3s", *args]  # fmt: skip
        out = subprocess.run(cmd, env={**os.environ, "ETCDCTL_API": "3"}, capture_output=True, text=True,
                             timeout=30, check=False)  # fmt: skip
        assert out.returncode == 0, f"etcdctl {args}: {out.stderr}"
        return out.stdout

    def members(self) -> dict[str, tuple[str, str]]:
        """name (or the peer URL of an unstarted member) -> (id, status)."""
        rows = [line.split(", ") for line in self.ctl("member", "list", "-w", "simple").splitlines() if line]
        return {(r[2] or r[3]): (r[0], r[1]) for r in rows}


@pytest.fixture
def cluster(tmp_path: Path, procs: ProcessGroup) -> Cluster:
    if not (os.path.isfile(ETCD_BIN) and os.path.isfile(ETCDCTL)):
        pytest.skip(f"etcd or etcdctl not found ({ETCD_BIN}, {ETCDCTL})")
    pki = tmp_path / "pki"
    made = subprocess.run(["sh", str(CERTS), str(pki)], env={**os.environ, "ETCD_CERT_EXTRA_SANS": "IP:127.0.0.1"},
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert made.returncode == 0, made.stderr
    return Cluster(tmp_path, pki, procs)


def test_a_member_that_lost_its_volume_is_removed_added_and_gets_the_data_back(cluster: Cluster) -> None:
    for name in NAMES:  # first start: no member answers yet
        out = cluster.prepare(name)
        assert out.returncode == 0 and "starting a new cluster" in out.stderr, out.stderr
        assert "initial-cluster-state: new" in cluster.config(name).read_text()
    for name in NAMES:
        cluster.start(name)
    wait_until(lambda: all(cluster.healthy(n) for n in NAMES), 60, interval=0.3, what="3 healthy members")
    assert {s for _, s in cluster.members().values()} == {"started"}
    old_id = cluster.members()["etcd-2"][0]
    cluster.ctl("put", "/elastictrain/job/hosts/a", "kept")

    # A restart with its data dir intact changes nothing in the cluster.
    out = cluster.prepare("etcd-0")
    assert out.returncode == 0 and "holds a member" in out.stderr, out.stderr

    # etcd-2's volume is lost: the pod comes back with an empty data dir.
    cluster.stop("etcd-2")
    subprocess.run(["rm", "-rf", str(cluster.data_dir("etcd-2"))], check=True)
    out = cluster.prepare("etcd-2")
    assert out.returncode == 0 and "its volume was lost; removing and adding it" in out.stderr, out.stderr
    config = cluster.config("etcd-2").read_text()
    assert "initial-cluster-state: existing" in config
    assert all(f"{n}={cluster.peer[n]}" in config for n in NAMES)
    cluster.start("etcd-2")
    wait_until(lambda: cluster.healthy("etcd-2"), 60, interval=0.3, what="etcd-2 healthy again")
    wait_until(
        lambda: {s for _, s in cluster.members().values()} == {"started"} and len(cluster.members()) == 3,
        60, interval=0.3, what="3 started members",
    )  # fmt: skip
    new_id = cluster.members()["etcd-2"][0]
    assert new_id != old_id, "a new member, not the lost one"
    local = cluster.ctl("get", "/elastictrain/job/hosts/a", "--print-value-only", "--consistency=s",
                        endpoints=cluster.client["etcd-2"])  # fmt: skip
    assert local.strip() == "kept", "the rejoined member has the data (a serializable read is served locally)"


def test_a_member_late_for_the_first_start_joins_and_a_rerun_after_its_add_does_not_add_it_twice(
    cluster: Cluster,
) -> None:
    for name in NAMES[:2]:
        assert cluster.prepare(name).returncode == 0
    for name in NAMES[:2]:
        cluster.start(name)  # 2 of 3 make a quorum; etcd-2 never started
    wait_until(lambda: all(cluster.healthy(n) for n in NAMES[:2]), 60, interval=0.3, what="2 healthy members")
    # etcdctl shows a member as started once it has a name, and the first start names all three: etcd-2 is
    # taken for a member that lost its volume (it has no data either way), removed and added.
    out = cluster.prepare("etcd-2")
    assert out.returncode == 0 and "removing and adding it" in out.stderr, out.stderr
    # The init container is restarted before etcd starts: the member is listed unstarted and not added again.
    out = cluster.prepare("etcd-2")
    assert out.returncode == 0 and "lists it as unstarted; joining" in out.stderr, out.stderr
    assert len(cluster.members()) == 3
    cluster.start("etcd-2")
    wait_until(lambda: cluster.healthy("etcd-2"), 60, interval=0.3, what="etcd-2 healthy")
    wait_until(lambda: {s for _, s in cluster.members().values()} == {"started"}, 60, interval=0.3, what="3 started")


def test_without_a_quorum_the_rejoin_exits_1_and_a_later_run_finishes_it(cluster: Cluster) -> None:
    for name in NAMES:
        assert cluster.prepare(name).returncode == 0
    for name in NAMES:
        cluster.start(name)
    wait_until(lambda: all(cluster.healthy(n) for n in NAMES), 60, interval=0.3, what="3 healthy members")
    cluster.stop("etcd-1")
    cluster.stop("etcd-2")
    subprocess.run(["rm", "-rf", str(cluster.data_dir("etcd-2"))], check=True)
    cluster.config("etcd-2").unlink()
    out = cluster.prepare("etcd-2", retry_seconds=4)
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines()[-1].startswith("etcd-member: error: member remove ")
    assert not cluster.config("etcd-2").exists(), "no config for etcd to start with"
    # A request that timed out may still commit once the quorum is back (etcd's semantics): the next run (the init
    # container's restart) finds the member either still listed or already removed, and finishes either way.
    cluster.start("etcd-1")
    wait_until(lambda: cluster.healthy("etcd-1"), 60, interval=0.3, what="etcd-1 back")
    out = cluster.prepare("etcd-2")
    assert out.returncode == 0 and "added to the cluster" in out.stderr, out.stderr
    cluster.start("etcd-2")
    wait_until(lambda: cluster.healthy("etcd-2"), 60, interval=0.3, what="etcd-2 rejoined")
    wait_until(
        lambda: len(cluster.members()) == 3 and {s for _, s in cluster.members().values()} == {"started"},
        60, interval=0.3, what="3 started members",
    )  # fmt: skip


def test_a_missing_setting_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = subprocess.run(["sh", str(SCRIPT)], env={"PATH": os.environ.get("PATH", "")}, capture_output=True,
                         text=True, timeout=30, check=False)  # fmt: skip
    assert out.returncode == 2 and out.stderr == "etcd-member: error: ETCD_MEMBER_NAME is not set\n"


def test_etcd_certs_refuses_to_overwrite_a_ca_and_a_bad_namespace(tmp_path: Path) -> None:
    (tmp_path / "ca.key").write_text("a CA key that must survive")
    out = subprocess.run(["sh", str(CERTS), str(tmp_path)], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 2 and "not overwriting a CA" in out.stderr
    assert (tmp_path / "ca.key").read_text() == "a CA key that must survive"
    out = subprocess.run(["sh", str(CERTS), str(tmp_path / "x"), "Bad_NS"], capture_output=True, text=True,
                         timeout=30, check=False)  # fmt: skip
    assert out.returncode == 2 and "invalid namespace" in out.stderr and not (tmp_path / "x").exists()
