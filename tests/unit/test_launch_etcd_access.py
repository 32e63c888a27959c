"""``launch --etcd`` with TLS and a user: what it passes to discover.sh, and that the password never shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastictrain.commands import format_command, horovodrun_command, launch_env
from elastictrain.errors import LaunchError
from elastictrain.launcher import main as launch_main
from elastictrain.launcher import options

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
SECRET = "launch-s3cret"


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name in ("ca.pem", "client.pem", "client-key.pem", "password"):
        (tmp_path / name).write_text(f"{SECRET}\n" if name == "password" else "pem")
        out[name] = str(tmp_path / name)
    return out


def test_tls_and_user_reach_discover_as_paths_and_the_printed_command_holds_no_password(
    tls_files: dict[str, str], tmp_path: Path
) -> None:
    opts, cfg = options.parse(["--config", str(DEMO), "--etcd", "https://etcd-0:2379,https://etcd-1:2379",
                              "--cacert", tls_files["ca.pem"], "--cert", tls_files["client.pem"],
                              "--key", tls_files["client-key.pem"], "--user", "trainer",
                              "--password-file", tls_files["password"]])  # fmt: skip
    assert opts.etcd_access is not None and opts.etcd_access.password() == SECRET
    env = launch_env(opts, etcd=opts.etcd or "", job=cfg.job, attempt=0, run_dir=tmp_path)
    assert env["ELASTICTRAIN_ETCD_CACERT"] == tls_files["ca.pem"]
    assert env["ELASTICTRAIN_ETCD_CERT"] == tls_files["client.pem"]
    assert env["ELASTICTRAIN_ETCD_KEY"] == tls_files["client-key.pem"]
    assert env["ELASTICTRAIN_ETCD_USER"] == "trainer"
    assert env["ELASTICTRAIN_ETCD_PASSWORD_FILE"] == tls_files["password"]
    printed = format_command(env, horovodrun_command(opts, ["horovodrun"]))
    assert SECRET not in printed


def test_settings_come_from_the_environment_like_the_flags(
    tls_files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTICTRAIN_ETCD_CACERT", tls_files["ca.pem"])
    monkeypatch.setenv("ELASTICTRAIN_ETCD_USER", "trainer")
    monkeypatch.setenv("ELASTICTRAIN_ETCD_PASSWORD_FILE", tls_files["password"])
    opts, _ = options.parse(["--config", str(DEMO), "--etcd", "https://etcd-0:2379"])
    assert opts.etcd_access is not None
    assert (opts.etcd_access.cacert, opts.etcd_access.user) == (tls_files["ca.pem"], "trainer")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--etcd", f"https://root:{SECRET}@etcd:2379"], "credentials do not belong in an endpoint URL"),
        (["--etcd", "http://etcd:2379", "--cacert", "{ca.pem}"], "--cacert need https:// etcd endpoints"),
        (["--etcd", "https://etcd:2379", "--user", "u"], "--user and --password-file go together"),
        (["--user", "u", "--password-file", "{password}"], "apply with --etcd only"),
    ],
)
def test_bad_access_flags_are_one_line_without_the_secret(
    tls_files: dict[str, str], argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [tls_files[a[1:-1]] if a.startswith("{") else a for a in argv]
    with pytest.raises(LaunchError) as e:
        options.parse(["--config", str(DEMO), *argv])
    assert message in str(e.value) and "\n" not in str(e.value) and SECRET not in str(e.value)
    assert launch_main.main(["--config", str(DEMO), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and SECRET not in err


def test_the_embedded_mode_ignores_inherited_etcd_settings(
    tls_files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTICTRAIN_ETCD_CACERT", tls_files["ca.pem"])
    monkeypatch.setattr(options, "local_logical_hosts", lambda count=None: ["localhost", "127.0.0.1"][:count])
    opts, _ = options.parse(["--config", str(DEMO)])
    assert opts.embedded and opts.etcd_access is None
