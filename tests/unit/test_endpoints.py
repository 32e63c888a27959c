"""Endpoint URLs, TLS files and credentials: one parser for the registry, the config and discover.sh."""

from __future__ import annotations

from pathlib import Path

import pytest

from discovery import discover, hosts_cli
from discovery.endpoints import Endpoint, EtcdAccess, parse_endpoints, read_password

SECRET = "s3cr3t-Pa55"


def test_http_https_ipv6_and_default_port() -> None:
    assert parse_endpoints("http://127.0.0.1:2379,10.0.0.2") == [
        Endpoint("http", "127.0.0.1", 2379),
        Endpoint("http", "10.0.0.2", 2379),
    ]
    assert parse_endpoints("https://etcd-0.etcd:2379/") == [Endpoint("https", "etcd-0.etcd", 2379)]
    v6 = parse_endpoints("http://[::1]:23790,http://[fd00::2]")
    assert v6 == [Endpoint("http", "::1", 23790), Endpoint("http", "fd00::2", 2379)]
    assert [e.url for e in v6] == ["http://[::1]:23790", "http://[fd00::2]:2379"]
    assert v6[0].loopback and not v6[1].loopback


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("ftp://x:1", "scheme must be http or https"),
        ("http://x:1/v3", "without a path"),
        ("http://x:1?password=" + SECRET, "without a path"),
        ("http://::1:2379", "IPv6 address in brackets"),
        ("http://[::1", "expected http://\\[IPV6\\]:PORT"),
        ("http://x:0", "port must be"),
        ("http://x:99999", "port must be"),
        ("http://x:", "port must be"),
        ("http://x y:1", "bad host name"),
        ("http://a:1,https://b:1", "mix of http:// and https://"),
        (" , ", "expected http\\(s\\)://"),
    ],
)
def test_bad_endpoints_are_refused_with_one_line(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        parse_endpoints(spec)
    assert "\n" not in str(err.value) and SECRET not in str(err.value)


@pytest.mark.parametrize("spec", [f"https://root:{SECRET}@etcd:2379", f"http://{SECRET}@etcd", f"root:{SECRET}@etcd:1"])
def test_credentials_in_an_endpoint_are_refused_without_echoing_them(spec: str) -> None:
    with pytest.raises(ValueError, match="credentials do not belong in an endpoint URL") as err:
        parse_endpoints(spec)
    assert SECRET not in str(err.value) and "root" not in str(err.value)
    assert "<credentials>@etcd" in str(err.value)


def files(tmp_path: Path, *names: str) -> list[str]:
    out = []
    for name in names:
        (tmp_path / name).write_text(f"{SECRET}\n" if name == "pw" else "pem")
        out.append(str(tmp_path / name))
    return out


def test_access_rules(tmp_path: Path) -> None:
    ca, cert, key, pw = files(tmp_path, "ca", "cert", "key", "pw")
    https, http = parse_endpoints("https://etcd:2379"), parse_endpoints("http://etcd:2379")
    EtcdAccess(cacert=ca, cert=cert, key=key, user="u", password_file=pw).check(https)
    EtcdAccess(user="u", password_file=pw).check(parse_endpoints("http://127.0.0.1:1,http://[::1]:2"))
    cases = [
        (EtcdAccess(cert=cert), https, "--cert and --key go together"),
        (EtcdAccess(user="u"), https, "--user and --password-file go together"),
        (EtcdAccess(password_file=pw), https, "--user and --password-file go together"),
        (EtcdAccess(user=f"u:{SECRET}", password_file=pw), https, "takes the user name only"),
        (EtcdAccess(cacert=ca), http, "--cacert need https:// etcd endpoints"),
        (EtcdAccess(user="u", password_file=pw), http, "would send the password in clear"),
        (EtcdAccess(cacert=str(tmp_path / "missing")), https, "not a readable file"),
    ]
    for access, endpoints, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            access.check(endpoints)
        assert SECRET not in str(err.value)
    with pytest.raises(ValueError, match="ELASTICTRAIN_ETCD_CERT and ELASTICTRAIN_ETCD_KEY"):
        EtcdAccess(cert=cert).check(https, names="env")


def test_password_file_and_environment_round_trip(tmp_path: Path) -> None:
    ca, pw = files(tmp_path, "ca", "pw")
    assert read_password(pw) == SECRET
    (tmp_path / "two").write_text("a\nb\n")
    with pytest.raises(ValueError, match="on one line"):
        read_password(str(tmp_path / "two"))
    access = EtcdAccess(cacert=ca, user="trainer", password_file=pw)
    env = access.env()
    assert env == {
        "ELASTICTRAIN_ETCD_CACERT": ca,
        "ELASTICTRAIN_ETCD_USER": "trainer",
        "ELASTICTRAIN_ETCD_PASSWORD_FILE": pw,
    }
    back = EtcdAccess.from_env(env)
    assert (back.cacert, back.user, back.password(), back.cert) == (ca, "trainer", SECRET, None)
    assert SECRET not in " ".join(access.argv()) and SECRET not in repr(access)


def discover_env(tmp_path: Path, etcd: str, **extra: str) -> dict[str, str]:
    return {"ELASTICTRAIN_ETCD": etcd, "ELASTICTRAIN_JOB": "job1",
            "ELASTICTRAIN_DISCOVER_CACHE": str(tmp_path / "cache.json"), **extra}  # fmt: skip


def test_discover_takes_ipv6_endpoints_like_the_registry(tmp_path: Path) -> None:
    cfg = discover.DiscoverConfig.from_env(discover_env(tmp_path, "http://[::1]:2379"))
    assert cfg.endpoints == [Endpoint("http", "::1", 2379)]


def test_discover_refuses_credentials_in_the_url_with_exit_2(tmp_path: Path) -> None:
    code, out, err = discover.run(discover_env(tmp_path, f"https://root:{SECRET}@127.0.0.1:2379"))
    assert (code, out, len(err)) == (2, [], 1) and "credentials do not belong" in err[0] and SECRET not in err[0]


def test_discover_reads_tls_and_user_from_the_environment(tmp_path: Path) -> None:
    ca, cert, key, pw = files(tmp_path, "ca", "cert", "key", "pw")
    env = discover_env(tmp_path, "https://127.0.0.1:2379", ELASTICTRAIN_ETCD_CACERT=ca,
                       ELASTICTRAIN_ETCD_CERT=cert, ELASTICTRAIN_ETCD_KEY=key,
                       ELASTICTRAIN_ETCD_USER="u", ELASTICTRAIN_ETCD_PASSWORD_FILE=pw)  # fmt: skip
    access = discover.DiscoverConfig.from_env(env).access
    assert (access.cacert, access.cert, access.key, access.user, access.password()) == (ca, cert, key, "u", SECRET)
    code, _, err = discover.run({**env, "ELASTICTRAIN_ETCD_KEY": ""})
    assert code == 2 and "ELASTICTRAIN_ETCD_CERT and ELASTICTRAIN_ETCD_KEY go together" in err[0]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--etcd", f"https://root:{SECRET}@127.0.0.1:2379"], "credentials do not belong"),
        (["--etcd", "https://127.0.0.1:2379", "--user", "u"], "--user and --password-file go together"),
    ],
)
def test_hosts_cli_refuses_bad_access_with_one_line(
    extra: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        hosts_cli.main([*extra, "--job", "j", "list"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and match in err and SECRET not in err


@pytest.mark.parametrize(
    "spec",
    ["https://etcd-0:2379,https://etcd-1:2379", "http://[::1]:2379", "ftp://etcd:2379", "https://a:1,http://b:1"],
)
def test_the_registry_and_discover_accept_and_refuse_the_same_endpoints(tmp_path: Path, spec: str) -> None:
    """One rule: https is accepted everywhere (the system's CAs unless --cacert / ELASTICTRAIN_ETCD_CACERT),
    and what one client refuses the other refuses with the same reason."""
    from discovery.registry import EtcdRegistry

    try:
        with EtcdRegistry(spec, "job1") as registry:  # parses and checks; connects only on first use
            registry_view: object = registry.endpoints
    except ValueError as e:
        registry_view = str(e)
    try:
        discover_view: object = discover.DiscoverConfig.from_env(discover_env(tmp_path, spec)).endpoints
    except discover.ConfigError as e:
        discover_view = str(e).removeprefix("ELASTICTRAIN_ETCD: ")
    assert registry_view == discover_view
    assert isinstance(registry_view, list) == spec.startswith(("https://etcd", "http://["))
