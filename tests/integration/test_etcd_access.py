"""etcd access: TLS with client certificates and auth (agent, discover.sh, hosts, launch's check), and IPv6 endpoints.

A real etcd runs with ``--client-cert-auth`` and certificates made in the test; auth is on, and the
user ``trainer`` has a role that may read and write only the job's prefix.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from discovery.endpoints import EtcdAccess
from discovery.record import HostRecord
from discovery.registry import EtcdRegistry, RegistryError, RegistryUnavailable
from elastictrain.errors import LaunchError
from elastictrain.launcher import main as launch_main
from elastictrain.launcher.etcd import ETCD_BIN, EtcdServer
from tests.fixtures.procs import REPO, VENV_BIN, ProcessGroup, wait_until
from tests.fixtures.tls import Pki, make_pki

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

DISCOVER_SH = REPO / "discovery" / "discover.sh"
ELASTICTRAIN = str(VENV_BIN / "elastictrain")
ETCDCTL = os.environ.get("ELASTICTRAIN_TEST_ETCDCTL", str(Path(ETCD_BIN).with_name("etcdctl")))
JOB = "securejob"
USER = "trainer"
PASSWORD = "Tr41ner-pw-7f3c9"  # what no log or command line may show
ROOT_PASSWORD = "R00t-pw-51e2a"
TTL = 4


def etcdctl(etcd: EtcdServer, pki: Pki, *args: str, stdin: str | None = None) -> None:
    """etcdctl with the test's client certificate; passwords go through stdin, never argv."""
    cmd = [ETCDCTL, f"--endpoints={etcd.endpoint}", f"--cacert={pki.ca}", f"--cert={pki.client_cert}",
           f"--key={pki.client_key}", "--dial-timeout=5s", *args]  # fmt: skip
    env = {**os.environ, "ETCDCTL_API": "3"}
    out = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30, env=env, check=False)
    assert out.returncode == 0, f"etcdctl {args}: {out.stderr}"


def enable_auth(server: EtcdServer, pki: Pki) -> None:
    """Users root and ``trainer``; ``trainer``'s role may read and write the job's prefix only; auth on."""
    etcdctl(server, pki, "user", "add", "root", "--interactive=false", stdin=ROOT_PASSWORD + "\n")
    etcdctl(server, pki, "role", "add", "job-writer")
    etcdctl(server, pki, "role", "grant-permission", "job-writer", "--prefix=true", "readwrite",
            f"/elastictrain/{JOB}/")  # fmt: skip
    etcdctl(server, pki, "user", "add", USER, "--interactive=false", stdin=PASSWORD + "\n")
    etcdctl(server, pki, "user", "grant-role", USER, "job-writer")
    etcdctl(server, pki, "auth", "enable")


@pytest.fixture
def secure_etcd(tmp_path: Path) -> tuple[EtcdServer, Pki]:
    if not (os.path.isfile(ETCD_BIN) and os.path.isfile(ETCDCTL)):
        pytest.skip(f"etcd or etcdctl not found ({ETCD_BIN}, {ETCDCTL})")
    pki = make_pki(tmp_path / "pki")
    server = EtcdServer(tmp_path / "etcd-data", tmp_path / "etcd.log", tls=pki.server)
    try:
        server.start()
        enable_auth(server, pki)
        yield server, pki
    finally:
        server.kill()


def access(pki: Pki, password_file: Path, *, cert: bool = True) -> EtcdAccess:
    return EtcdAccess(
        cacert=str(pki.ca),
        cert=str(pki.client_cert) if cert else None,
        key=str(pki.client_key) if cert else None,
        user=USER,
        password_file=str(password_file),
    )


def access_flags(pki: Pki, password_file: Path) -> list[str]:
    return ["--cacert", str(pki.ca), "--cert", str(pki.client_cert), "--key", str(pki.client_key),
            "--user", USER, "--password-file", str(password_file)]  # fmt: skip


def discover(etcd: EtcdServer, cache: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "ELASTICTRAIN_ETCD": etcd.endpoint, "ELASTICTRAIN_JOB": JOB,
                "ELASTICTRAIN_DISCOVER_CACHE": str(cache), "ELASTICTRAIN_DISCOVER_TIMEOUT": "2", **env}  # fmt: skip
    return subprocess.run([str(DISCOVER_SH)], env=full_env, capture_output=True, text=True, timeout=20, check=False)


def listed(etcd: EtcdServer, acc: EtcdAccess) -> dict[str, str]:
    with EtcdRegistry(etcd.endpoint, JOB, timeout_seconds=2.0, access=acc) as registry:
        return {e.record.host: e.record.state for e in registry.list_hosts().entries}


def command_lines_holding(secret: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if secret in cmdline:
            found.append(cmdline)
    return found


def test_agent_registers_discover_lists_and_no_secret_leaks_over_tls_and_auth(
    secure_etcd: tuple[EtcdServer, Pki], procs: ProcessGroup, tmp_path: Path
) -> None:
    etcd, pki = secure_etcd
    password_file = tmp_path / "etcd-password"
    password_file.write_text(PASSWORD + "\n")
    password_file.chmod(0o600)
    acc = access(pki, password_file)
    agent_log = tmp_path / "agent.log"
    with agent_log.open("ab") as log:
        agent = procs.start(
            [ELASTICTRAIN, "agent", "--etcd", etcd.endpoint, "--job", JOB, "--host", "node-a", "--slots", "2",
             "--ttl", "3", "--heartbeat", "0.5", "--request-timeout", "0.5", *access_flags(pki, password_file)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    wait_until(lambda: listed(etcd, acc) == {"node-a": "ready"}, 20, interval=0.2, what="node-a registered")

    # discover.sh, with the environment launch gives it, lists the host.
    out = discover(etcd, tmp_path / "cache.json", acc.env())
    assert (out.returncode, out.stdout) == (0, "node-a:2\n"), out.stderr
    hosts = subprocess.run(
        [ELASTICTRAIN, "hosts", "--etcd", etcd.endpoint, "--job", JOB, *access_flags(pki, password_file), "list"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert hosts.returncode == 0 and hosts.stdout.split()[6:9] == ["node-a", "2", "ready"], hosts.stderr
    launch_main.check_etcd(etcd.endpoint, JOB, "/elastictrain", access=acc)  # launch --etcd's start-up check passes

    # A client without a certificate is refused by the TLS handshake: the registry, discover.sh, launch.
    with (
        pytest.raises(RegistryUnavailable),
        EtcdRegistry(
            etcd.endpoint, JOB, timeout_seconds=2.0, access=access(pki, password_file, cert=False)
        ) as registry,
    ):
        registry.list_hosts()
    no_cert = {k: v for k, v in acc.env().items() if k not in ("ELASTICTRAIN_ETCD_CERT", "ELASTICTRAIN_ETCD_KEY")}
    refused = discover(etcd, tmp_path / "other-cache.json", no_cert)
    assert refused.returncode == 1 and refused.stdout == "" and "etcd unreachable" in refused.stderr
    with pytest.raises(LaunchError, match="unreachable"):
        launch_main.check_etcd(etcd.endpoint, JOB, "/elastictrain", access=access(pki, password_file, cert=False))

    # A wrong password is refused, and so is a certificate alone (its name is no etcd user).
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    denied = discover(etcd, tmp_path / "third-cache.json", {**acc.env(), "ELASTICTRAIN_ETCD_PASSWORD_FILE": str(wrong)})
    assert denied.returncode == 1 and "authentication failed" in denied.stderr
    with pytest.raises(RegistryError), EtcdRegistry(
        etcd.endpoint, JOB, timeout_seconds=2.0, access=EtcdAccess(cacert=str(pki.ca), cert=str(pki.client_cert),
                                                                  key=str(pki.client_key))
    ) as registry:  # fmt: skip
        registry.list_hosts()

    # The role covers this job's prefix only: another job's key cannot be written with the same user.
    with EtcdRegistry(etcd.endpoint, "otherjob", timeout_seconds=2.0, access=acc) as other:
        lease = other.grant_lease(5)
        with pytest.raises(RegistryError, match="permission denied"):
            other.register(HostRecord(host="rogue", slots=8, addr="10.9.9.9"), lease)

    # No secret in any process's command line (the agent runs now) or in any log.
    assert agent.poll() is None
    assert command_lines_holding(PASSWORD) == []
    assert command_lines_holding(ROOT_PASSWORD) == []
    texts = {
        "agent log": agent_log.read_text(errors="replace"),
        "discover stderr": out.stderr + refused.stderr + denied.stderr,
        "hosts output": hosts.stdout + hosts.stderr,
        "etcd log": etcd.log_path.read_text(errors="replace"),
    }
    for where, text in texts.items():
        assert PASSWORD not in text, f"the password appears in the {where}"
    assert "user trainer" in texts["agent log"]  # the agent says what it uses, without the secret


def test_the_agent_keeps_draining_and_heartbeating_across_an_etcd_restart(
    secure_etcd: tuple[EtcdServer, Pki], procs: ProcessGroup, tmp_path: Path
) -> None:
    etcd, pki = secure_etcd
    password_file = tmp_path / "etcd-password"
    password_file.write_text(PASSWORD)
    acc = access(pki, password_file)
    agent_log = tmp_path / "agent.log"
    with agent_log.open("ab") as log:
        agent = procs.start(
            [ELASTICTRAIN, "agent", "--etcd", etcd.endpoint, "--job", JOB, "--host", "node-a", "--slots", "1",
             "--ttl", str(TTL), "--heartbeat", "0.5", "--request-timeout", "1", *access_flags(pki, password_file)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    wait_until(lambda: listed(etcd, acc) == {"node-a": "ready"}, 20, interval=0.2, what="node-a registered")
    with EtcdRegistry(etcd.endpoint, JOB, access=acc) as registry:
        entry = registry.get("node-a")
    assert entry is not None
    etcd.restart()
    # A drain needs a read and a compare-and-set by the agent, under its credentials, after the restart.
    agent.send_signal(signal.SIGTERM)
    wait_until(lambda: listed(etcd, acc) == {"node-a": "draining"}, 5, interval=0.2, what="node-a draining")
    with EtcdRegistry(etcd.endpoint, JOB, access=acc) as registry:
        again = registry.get("node-a")
    assert again is not None and again.lease_id == entry.lease_id
    assert PASSWORD not in agent_log.read_text(errors="replace")


def test_an_expired_auth_token_is_renewed_by_logging_in_again(tmp_path: Path) -> None:
    """etcd drops a simple token unused for --auth-token-ttl seconds; the registry's next call logs in again."""
    if not (os.path.isfile(ETCD_BIN) and os.path.isfile(ETCDCTL)):
        pytest.skip(f"etcd or etcdctl not found ({ETCD_BIN}, {ETCDCTL})")
    pki = make_pki(tmp_path / "pki")
    etcd = EtcdServer(
        tmp_path / "etcd-data", tmp_path / "etcd.log", tls=pki.server, extra_args=("--auth-token-ttl", "1")
    )
    try:
        etcd.start()
        enable_auth(etcd, pki)
        password_file = tmp_path / "etcd-password"
        password_file.write_text(PASSWORD)
        with EtcdRegistry(etcd.endpoint, JOB, timeout_seconds=2.0, access=access(pki, password_file)) as registry:
            assert registry.list_hosts().entries == []
            first_client = registry._client
            time.sleep(2.5)  # the fault: the token outlives its TTL on the server (etcd checks it once a second)
            assert registry.list_hosts().entries == []
            assert registry._client is not first_client, "the registry logged in again"
    finally:
        etcd.kill()


def test_discover_and_the_registry_reach_etcd_on_an_ipv6_endpoint(tmp_path: Path) -> None:
    if not os.path.isfile(ETCD_BIN):
        pytest.skip(f"etcd not found ({ETCD_BIN})")
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    etcd = EtcdServer(tmp_path / "etcd-data", tmp_path / "etcd.log", host="::1")
    try:
        etcd.start()
        assert etcd.endpoint.startswith("http://[::1]:")
        with EtcdRegistry(etcd.endpoint, JOB) as registry:
            registry.register(HostRecord(host="node-6", slots=3, addr="::1"), registry.grant_lease(30))
        out = discover(etcd, tmp_path / "cache.json", {})
        assert (out.returncode, out.stdout) == (0, "node-6:3\n"), out.stderr
    finally:
        etcd.kill()
