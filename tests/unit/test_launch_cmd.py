"""``elastictrain launch``: the horovodrun command, its environment, flag validation and the decision after an exit.

No process is started here: parsing, command building and :func:`decide_after_exit` are pure.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from discovery.record import DRAINING, READY
from elastictrain.commands import format_command, horovodrun_command, launch_env, runner_command
from elastictrain.errors import LaunchError
from elastictrain.launcher import decisions, etcd, hosts, options
from elastictrain.launcher import main as launch_main
from elastictrain.launcher.decisions import (
    EXIT_COMPLETED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_RELAUNCH_LIMIT,
    EXIT_STOPPED,
    HostWatch,
    Outcome,
    decide_after_exit,
)
from elastictrain.launcher.options import LaunchOptions
from elastictrain.rundir import launch, layout

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"


def flag(cmd: list[str], name: str, n: int = 1) -> list[str]:
    i = cmd.index(name)
    return cmd[i + 1 : i + 1 + n]


def test_embedded_command_has_discovery_bounds_local_interface_and_the_worker_after_extra_flags() -> None:
    opts = LaunchOptions(config=DEMO, overrides=("training.epochs=1",), min_np=2, max_np=3, extra=("--verbose",))
    cmd = horovodrun_command(opts, runner_command("/venv/bin/python"), python="/venv/bin/python")
    assert cmd[:3] == ["/venv/bin/python", "-m", "elastictrain.horovod.hvdrun"]
    assert flag(cmd, "-np") == ["2"]
    assert flag(cmd, "--min-np") == ["2"]
    assert flag(cmd, "--max-np") == ["3"]
    assert flag(cmd, "--host-discovery-script") == [str(REPO / "discovery" / "discover.sh")]
    assert flag(cmd, "--network-interfaces") == ["lo"]
    assert "--gloo" in cmd
    assert flag(cmd, "--gloo-timeout-seconds") == ["60"]
    assert flag(cmd, "--blacklist-cooldown-range", 2) == ["5", "60"]
    assert flag(cmd, "--reset-limit") == ["100"]
    train = cmd.index("train")
    assert cmd.index("--verbose") < train, "extra horovodrun flags go before the worker command"
    assert cmd[train:] == ["train", "--config", str(DEMO.resolve()), "--set", "training.epochs=1"]


def test_cluster_command_does_not_pin_the_loopback_interface() -> None:
    opts = LaunchOptions(config=DEMO, min_np=4, max_np=8, etcd="http://etcd-0:2379")
    cmd = horovodrun_command(opts, ["horovodrun"])
    assert "--network-interfaces" not in cmd
    assert flag(cmd, "-np") == ["4"]


def test_env_names_etcd_job_attempt_and_shares_cores_between_local_logical_hosts(tmp_path: Path) -> None:
    opts = LaunchOptions(config=DEMO, min_np=2, max_np=3)
    env = launch_env(opts, etcd="http://127.0.0.1:1", job="j", attempt=2, run_dir=tmp_path, cores=8)
    assert env["ELASTICTRAIN_ETCD"] == "http://127.0.0.1:1"
    assert env["ELASTICTRAIN_JOB"] == "j"
    assert env["ELASTICTRAIN_ATTEMPT"] == "2"
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["ELASTICTRAIN_DISCOVER_CACHE"] == str(tmp_path / "discover-cache.json")
    assert launch_env(opts, etcd="e", job="j", attempt=0, run_dir=tmp_path, cores=2)["OMP_NUM_THREADS"] == "1"
    cluster = LaunchOptions(config=DEMO, min_np=2, max_np=3, etcd="http://e:2379")
    assert "OMP_NUM_THREADS" not in launch_env(cluster, etcd="http://e:2379", job="j", attempt=0, run_dir=tmp_path)


def test_printed_command_can_be_pasted_into_a_shell() -> None:
    line = format_command({"A": "x y"}, ["horovodrun", "--set", "a=b c"])
    assert line == "A='x y' horovodrun --set 'a=b c'"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--min-np", "3", "--max-np", "2"], "--max-np (2) must be >= --min-np (3)"),
        (["--min-np", "0"], "--min-np must be >= 1"),
        (["--blacklist-cooldown-range", "0", "5"], "--blacklist-cooldown-range"),
        (["--etcd", "ftp://x:1"], "--etcd"),
        (["--etcd", "http://e:2379", "--hosts", "localhost"], "--hosts applies to the embedded mode only"),
        (["--hosts", "localhost,localhost"], "duplicate"),
        (["--wait-hosts-seconds", "nan"], "--wait-hosts-seconds must be a finite number >= 0, got nan"),
        (["--wait-hosts-seconds", "inf"], "--wait-hosts-seconds must be a finite number >= 0, got inf"),
        (["--wait-hosts-seconds", "-1"], "--wait-hosts-seconds must be a finite number >= 0, got -1.0"),
        (["--stop-timeout", "nan"], "--stop-timeout must be a finite number >= 0"),
        (["--stop-timeout=-inf"], "--stop-timeout must be a finite number >= 0"),
        (["--drain-grace", "nan"], "--drain-grace must be a finite number >= 0"),
        (["--drain-grace", "inf"], "--drain-grace must be a finite number >= 0"),
        (["--drain-grace", "-0.5"], "--drain-grace must be a finite number >= 0"),
        (["--elastic-timeout", "-1"], "--elastic-timeout must be a finite number >= 0"),
        (["--reset-limit", "-3"], "--reset-limit must be a finite number >= 0"),
    ],
)
def test_bad_flags_are_one_clear_error(argv: list[str], message: str) -> None:
    with pytest.raises(LaunchError, match=None) as e:
        options.parse(["--config", str(DEMO), *argv])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["--elastic-timeout", "nan"],
        ["--reset-limit", "inf"],
        ["--stop-timeout", "nan"],
        ["--job", ".."],
        ["--job=-x"],
        ["--job", "caf\u00e9"],
        ["--set", "job=a/b"],
    ],
)
def test_bad_launch_input_exits_2_with_one_line_and_no_traceback(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = launch_main.main(["--config", str(DEMO), "--set", f"run_dir={tmp_path / 'run'}", *argv])
    except SystemExit as e:  # argparse's own one-line errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("elastictrain launch: "), err
    assert not (tmp_path / "run").exists(), "nothing is created for a refused launch"


def test_a_host_that_is_not_this_machine_is_refused_in_the_embedded_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosts, "resolve", lambda name: "10.9.9.9" if name == "far" else "127.0.0.1")
    with pytest.raises(LaunchError, match="'far' does not resolve to this machine"):
        options.parse(["--config", str(DEMO), "--hosts", "localhost,far"])


def test_more_min_np_than_local_logical_hosts_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(options, "local_logical_hosts", lambda count=None: ["localhost", "127.0.0.1"][:count])
    with pytest.raises(LaunchError, match="needs 3 logical hosts but this machine has 2"):
        options.parse(["--config", str(DEMO), "--min-np", "3"])


def test_defaults_come_from_the_config_and_flags_after_double_dash_pass_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        options, "local_logical_hosts", lambda count=None: ["localhost", "127.0.0.1", "h", "10.0.0.1"][:count]
    )
    opts, cfg = options.parse(["--config", str(DEMO), "--job", "other", "--", "--verbose", "--start-timeout", "60"])
    assert (opts.min_np, opts.max_np) == (cfg.elastic.min_np, cfg.elastic.max_np) == (2, 3)
    assert cfg.job == "other" and "job=other" in opts.overrides
    assert opts.hosts == ("localhost", "127.0.0.1", "h"), "agents for at most max_np logical hosts"
    assert opts.extra == ("--verbose", "--start-timeout", "60")


def test_min_np_above_the_configs_max_np_raises_the_default_max(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(options, "local_logical_hosts", lambda count=None: ["a", "b", "c", "d"][:count])
    opts, _ = options.parse(["--config", str(DEMO), "--min-np", "4"])
    assert (opts.min_np, opts.max_np) == (4, 4)


def test_missing_config_is_a_config_error(tmp_path: Path) -> None:
    from elastictrain.config import ConfigError

    with pytest.raises(ConfigError, match="config file not found"):
        options.parse(["--config", str(tmp_path / "nope.yaml")])


def test_local_logical_hosts_resolve_to_this_machine() -> None:
    names = hosts.local_logical_hosts()
    assert names[:2] == ["localhost", "127.0.0.1"]
    local = hosts.local_addresses()
    assert all(hosts.resolve(h) in local for h in names)
    if hosts.resolve(socket.gethostname()) in local:
        assert socket.gethostname() in names


def test_more_logical_hosts_than_names_come_from_the_loopback_network() -> None:
    if not hosts.loopback_aliases_work():
        pytest.skip("this kernel does not answer on 127.0.0.2")
    named = hosts.local_logical_hosts()
    many = hosts.local_logical_hosts(32)
    assert len(many) == len(set(many)) == 32
    assert many[: len(named)] == named, "the named hosts first, in the same order"
    extra = many[len(named) :]
    assert all(hosts.is_loopback(h) and hosts.is_local(h) for h in extra)
    assert "127.0.0.1" not in extra and len({hosts.resolve(h) for h in many}) >= 32 - len(named) + 1
    assert hosts.local_logical_hosts(2) == named[:2]


def test_launch_starts_agents_for_max_np_logical_hosts_beyond_the_four_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not hosts.loopback_aliases_work():
        pytest.skip("this kernel does not answer on 127.0.0.2")
    opts, _ = options.parse(["--config", str(DEMO), "--min-np", "4", "--max-np", "12"])
    assert len(opts.hosts) == 12 and len(set(opts.hosts)) == 12
    opts, _ = options.parse(["--config", str(DEMO), "--hosts", "127.0.0.9,127.0.0.10", "--min-np", "2"])
    assert opts.hosts == ("127.0.0.9", "127.0.0.10")


# ------------------------------------------------------------------------------------------ decisions
def decide(**kw: object) -> decisions.RelaunchDecision:
    args: dict = dict(
        returncode=1, completed=False, hosts_lost=[], min_ready_slots=2, min_np=2, relaunches=0, max_relaunches=5
    )
    args.update(kw)
    return decide_after_exit(**args)


def test_completed_only_when_horovodrun_exits_0_and_the_events_end_with_done() -> None:
    assert decide(returncode=0, completed=True).exit_code == EXIT_COMPLETED
    assert decide(returncode=0, completed=False).exit_code == EXIT_FAILED


def test_a_failure_with_every_host_still_registered_is_not_relaunched() -> None:
    d = decide(returncode=1)
    assert (d.outcome, d.exit_code) == (Outcome.FAILED, EXIT_FAILED)
    assert "not a preemption" in d.reason


def test_lost_hosts_or_too_few_ready_slots_relaunch_until_the_cap() -> None:
    d = decide(hosts_lost=["localhost", "127.0.0.1"], min_ready_slots=0)
    assert d.outcome is Outcome.RELAUNCH and d.exit_code is None
    assert "hosts lost: localhost, 127.0.0.1" in d.reason and "relaunch 1" in d.reason
    assert decide(min_ready_slots=1).outcome is Outcome.RELAUNCH
    capped = decide(hosts_lost=["a"], relaunches=5)
    assert (capped.outcome, capped.exit_code) == (Outcome.RELAUNCH_LIMIT, EXIT_RELAUNCH_LIMIT)


def test_a_stop_signal_wins_over_everything() -> None:
    assert decide(returncode=0, completed=True, stop_signal=signal.SIGTERM).exit_code == EXIT_STOPPED
    assert decide(hosts_lost=["a"], stop_signal=signal.SIGINT).exit_code == EXIT_INTERRUPTED


def entry(host: str, state: str = READY, pid: int = 1, at: float = 1.0) -> SimpleNamespace:
    return SimpleNamespace(record=SimpleNamespace(host=host, slots=1, state=state, pid=pid, registered_at=at))


def test_host_watch_counts_vanished_and_reregistered_hosts_as_lost_but_not_drained_ones() -> None:
    w = HostWatch()
    w.observe([entry("a"), entry("b"), entry("c")])
    w.observe([entry("a"), entry("b", pid=2, at=5.0), entry("c", state=DRAINING)])
    assert w.lost == {"b"} and w.min_ready_slots == 2
    w.observe([entry("a")])  # the drained host's lease ends: not lost
    assert w.lost == {"b"}
    w.observe([])
    assert w.lost == {"a", "b"} and w.min_ready_slots == 0 and w.ready_slots == 0


# ------------------------------------------------------------------------------------------ deploy/k8s
K8S = REPO / "deploy" / "k8s"


def k8s_documents() -> list[dict]:
    import yaml

    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    pod = spec.get("template", {}).get("spec", {}) if "template" in spec else spec
    return list(pod.get("containers", []))


def test_k8s_manifests_parse_and_hold_the_agent_daemonset_launcher_job_and_etcd() -> None:
    docs = k8s_documents()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("DaemonSet", "elastictrain-agent") in kinds
    assert ("Job", "elastictrain-resnet50") in kinds
    assert ("StatefulSet", "etcd") in kinds and ("Service", "etcd") in kinds
    assert {d["apiVersion"] for d in docs} <= {
        "v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1", "rbac.authorization.k8s.io/v1"
    }  # fmt: skip
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    assert all(d["metadata"].get("namespace") == "elastictrain" for d in docs if d["kind"] not in cluster_scoped)
    import yaml

    from elastictrain.config import config_from_dict

    (job_config,) = [d["data"]["job.yaml"] for d in docs if d["kind"] == "ConfigMap"]
    cfg = config_from_dict(yaml.safe_load(job_config))
    assert cfg.job == "resnet50" and cfg.device == "cuda"


def test_k8s_command_lines_name_real_subcommands_with_flags_their_parsers_accept() -> None:
    from discovery import agent
    from elastictrain.cli import SUBCOMMANDS

    seen = set()
    env_values = {"$(NODE_NAME)": "gpu-node-1", "$(GPUS_PER_NODE)": "8"}
    for doc in k8s_documents():
        for c in containers(doc):
            if c.get("command") != ["elastictrain"]:
                continue
            args = [env_values.get(a, a) for a in c["args"]]
            assert args[0] in SUBCOMMANDS, args[0]
            seen.add(args[0])
            if args[0] == "agent":
                agent.config_from_args(agent.build_parser().parse_args(args[1:]))  # raises on a bad flag or timing
            elif args[0] == "launch":
                rest = args[1:]
                own = rest[: rest.index("--")] if "--" in rest else rest
                ns = options.build_parser().parse_args(own)
                assert ns.etcd and ns.hosts is None, "on a cluster the launcher uses its etcd and starts no agents"
                assert ns.config.startswith("/etc/elastictrain/")
    assert seen == {"agent", "launch"}


def test_a_horovodrun_that_kept_no_worker_alive_is_relaunched_not_called_a_crash():
    d = decide_after_exit(
        returncode=-15,
        completed=False,
        hosts_lost=[],
        min_ready_slots=3,
        min_np=2,
        relaunches=0,
        max_relaunches=5,
        stalled="no worker alive for 200s while 3 slots were ready",
    )
    assert d.outcome == decisions.Outcome.RELAUNCH and "no worker alive" in str(d)
    crash = decide_after_exit(
        returncode=1, completed=False, hosts_lost=[], min_ready_slots=3, min_np=2, relaunches=0, max_relaunches=5
    )
    assert crash.exit_code == decisions.EXIT_FAILED


@pytest.mark.parametrize(("gloo", "cooldown"), [(60, (5, 60)), (15, (1, 2)), (600, (30, 900))])
def test_the_stall_deadline_outlasts_every_legitimate_pause_without_workers(
    gloo: int, cooldown: tuple[int, int]
) -> None:
    """Workers may all be gone while survivors wait out a Gloo timeout, a host sits out its longest blacklist
    cooldown and new workers start: a stall declared before all of that would relaunch a healthy job."""
    opts = options.LaunchOptions(config=Path("c.yaml"), min_np=2, max_np=3, gloo_timeout_seconds=gloo,
                                blacklist_cooldown=cooldown)  # fmt: skip
    slower = options.LaunchOptions(config=Path("c.yaml"), min_np=2, max_np=3, gloo_timeout_seconds=gloo * 2,
                                  blacklist_cooldown=(cooldown[0], cooldown[1] * 2))  # fmt: skip
    assert opts.stall_seconds >= gloo + cooldown[1] + 30, "no time left for a worker to start"
    assert slower.stall_seconds >= opts.stall_seconds + gloo + cooldown[1]


def test_one_launcher_per_run_dir_and_the_refusal_names_the_holder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = launch.RunDirLock.acquire(run_dir)
    try:
        before = sorted(p.name for p in run_dir.iterdir())
        with pytest.raises(LaunchError) as e:
            launch.RunDirLock.acquire(run_dir)  # another open file: flock excludes it as it would another process
        assert f"is driven by a live launcher (pid {os.getpid()} on {socket.gethostname()})" in str(e.value)
        assert "\n" not in str(e.value)
        assert sorted(p.name for p in run_dir.iterdir()) == before == [layout.LAUNCH_LOCK]
    finally:
        first.release()
    launch.RunDirLock.acquire(run_dir).release()  # free again once the holder is gone


def test_the_lock_file_is_not_inherited_by_children(tmp_path: Path) -> None:
    lock = launch.RunDirLock.acquire(tmp_path)
    try:
        assert not os.get_inheritable(lock.fd)
        assert fcntl.fcntl(lock.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        lock.release()


def test_a_data_dir_whose_database_is_locked_belongs_to_a_live_etcd(tmp_path: Path) -> None:
    data_dir = tmp_path / "etcd"
    assert not etcd.etcd_data_dir_in_use(data_dir), "no data dir: nothing to protect"
    db = data_dir / "member" / "snap" / "db"
    db.parent.mkdir(parents=True)
    db.write_bytes(b"")
    assert not etcd.etcd_data_dir_in_use(data_dir), "a dead etcd's data dir may be wiped"
    with db.open("rb") as held:  # what a running etcd (bbolt) holds on its database
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        assert etcd.etcd_data_dir_in_use(data_dir)
    assert db.exists()


def test_every_launch_flag_defaults_to_the_options_dataclass_field() -> None:
    import dataclasses

    ns = options.build_parser().parse_args(["--config", "c.yaml"])
    fields = {f.name: f.default for f in dataclasses.fields(LaunchOptions)}
    # --min-np/--max-np/--hosts default from the job's config and the machine, not from the dataclass.
    shared = set(vars(ns)) & set(fields) - {"config", "overrides", "min_np", "max_np", "hosts"}
    assert {"gloo_timeout_seconds", "reset_limit", "wait_hosts_seconds", "stop_timeout_seconds"} <= shared
    for name in shared:
        default = fields[name]
        assert getattr(ns, name) == (list(default) if isinstance(default, tuple) else default), name


def test_hot_join_and_the_task_trial_are_on_without_flags_and_each_has_an_off_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from elastictrain.commands import ZYGOTE_CLIENT, config_validate_command, worker_command

    monkeypatch.setattr(options, "local_logical_hosts", lambda count=None: ["localhost", "127.0.0.1"][:count])
    opts, _ = options.parse(["--config", str(DEMO)])
    assert opts.hot_join and opts.task_trial and opts.task_trial_seconds == 60
    assert tuple(worker_command(opts, "/py")[1 : 1 + len(ZYGOTE_CLIENT)]) == ZYGOTE_CLIENT
    off, _ = options.parse(["--config", str(DEMO), "--no-hot-join", "--no-task-trial"])
    assert not off.hot_join and not off.task_trial
    assert worker_command(off, "/py")[1:3] == ["-m", "elastictrain.cli"]
    assert config_validate_command(DEMO, (), "/py", trial_seconds=7.5)[-2:] == ["--trial-seconds", "7.5"]
    assert "--no-trial" in config_validate_command(DEMO, (), "/py")
    with pytest.raises(LaunchError, match="--task-trial-seconds must be a finite number > 0"):
        options.parse(["--config", str(DEMO), "--task-trial-seconds", "nan"])
