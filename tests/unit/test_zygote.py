"""Hot join's zygote and client: real processes on a real AF_UNIX socket.

The serving zygote here runs a stand-in for ``worker.main`` (so that no horovodrun is needed); everything
else (the fork, the fds, the environment, signal relay, exit codes, the client's cold fallback) is the
code a job runs. One test warms a real zygote on a real config and counts its threads.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path

import psutil
import pytest

from elastictrain.commands import worker_command
from elastictrain.hotjoin import client, protocol
from elastictrain.hotjoin import server as zygote
from elastictrain.launcher.options import LaunchOptions
from elastictrain.launcher.processes import runs_train
from tests.fixtures.procs import REPO, ProcessGroup, wait_until

SERVER = """
import os, signal, sys
from elastictrain.engine import worker
from elastictrain.hotjoin import protocol
from elastictrain.hotjoin import server as zygote

def stand_in(args):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print("worker", os.getppid(), os.getcwd(), os.environ.get("PROBE"), " ".join(args), flush=True)
    if args[0] == "wait":
        while True:
            signal.pause()
    return int(args[0])

worker.main = stand_in
path = protocol.socket_path("job1", "h1")
z = zygote.Zygote(zygote.listen(path), path)
print(protocol.READY_LINE, os.getpid(), flush=True)
sys.exit(z.serve())
"""


@pytest.fixture
def procs():
    group = ProcessGroup()
    yield group
    group.cleanup()


@pytest.fixture
def sockdir(monkeypatch) -> Path:
    # Short: AF_UNIX paths hold at most 107 bytes, and pytest's tmp_path can be longer.
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="zt-", dir="/tmp"))
    monkeypatch.setenv(protocol.DIR_ENV, str(d / "z"))
    yield d / "z"
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def client_env(**extra: str) -> dict[str, str]:
    inherited = {k: v for k, v in os.environ.items() if k not in ("ELASTICTRAIN_ETCD", "ELASTICTRAIN_ETCD_PREFIX")}
    return {**inherited, "ELASTICTRAIN_JOB": "job1", "HOROVOD_HOSTNAME": "h1", "PYTHONPATH": str(REPO), **extra}


def start_client(procs: ProcessGroup, *args: str, cwd: Path | None = None, **env: str) -> subprocess.Popen:
    cold = [sys.executable, "-c", "import sys; print('cold', *sys.argv[1:])", "train", *args]
    return procs.start(
        [sys.executable, "-m", "elastictrain.hotjoin.client", "--", *cold],
        env=client_env(**env),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def server(procs, sockdir) -> subprocess.Popen:
    proc = procs.start(
        [sys.executable, "-c", SERVER], env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(protocol.READY_LINE), line
    return proc


def test_worker_gets_the_clients_args_env_cwd_and_streams_and_its_exit_code(server, procs, tmp_path):
    c = start_client(procs, "7", "--config", "x.yaml", cwd=tmp_path, PROBE="hello")
    out, err = c.communicate(timeout=60)
    assert c.returncode == 7, err
    word, ppid, cwd, probe, args = out.split(" ", 4)
    assert (word, int(ppid), cwd, probe, args.strip()) == (
        "worker",
        server.pid,
        str(tmp_path),
        "hello",
        "7 --config x.yaml",
    )


def test_sigterm_to_the_client_reaches_the_worker(server, procs):
    c = start_client(procs, "wait")
    assert c.stdout is not None
    worker_line = c.stdout.readline()  # the worker is running (it printed before it waits for a signal)
    assert worker_line.startswith("worker "), worker_line
    c.send_signal(signal.SIGTERM)
    assert c.wait(timeout=60) == 143


def worker_children(server: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(server.pid).children()


def test_a_killed_client_takes_its_worker_down(server, procs):
    c = start_client(procs, "wait")
    assert c.stdout is not None and c.stdout.readline().startswith("worker ")
    (worker,) = worker_children(server)
    c.kill()
    c.wait(timeout=10)
    wait_until(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 30, what="worker gone")


def test_a_killed_worker_kills_its_client_with_the_same_signal(server, procs):
    c = start_client(procs, "wait")
    assert c.stdout is not None and c.stdout.readline().startswith("worker ")
    (worker,) = worker_children(server)
    worker.kill()
    assert c.wait(timeout=60) == -signal.SIGKILL


def test_without_a_zygote_the_client_runs_the_cold_command(procs, sockdir):
    c = start_client(procs, "3")
    out, _ = c.communicate(timeout=60)
    assert (c.returncode, out.strip()) == (0, "cold train 3")


def test_sigterm_to_the_zygote_waits_for_its_workers_then_removes_the_socket(server, procs):
    c = start_client(procs, "wait")
    assert c.stdout is not None and c.stdout.readline().startswith("worker ")
    server.send_signal(signal.SIGTERM)
    path = protocol.socket_path("job1", "h1")
    wait_until(lambda: not path.exists(), 30, what="socket removed")
    assert server.poll() is None, "the zygote must outlive its running worker"
    c.send_signal(signal.SIGTERM)
    assert c.wait(timeout=60) == 143
    assert server.wait(timeout=30) == 0


def test_another_user_cannot_use_the_zygote(server, sockdir):
    path = protocol.socket_path("job1", "h1")
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"


@pytest.mark.parametrize(
    ("request_", "fds", "error"),
    [
        ({"args": "x", "env": {}, "cwd": "/"}, 3, "args"),
        ({"args": [], "env": {"A": 1}, "cwd": "/"}, 3, "env"),
        ({"args": [], "env": {}, "cwd": "relative"}, 3, "cwd"),
        ({"args": [], "env": {}, "cwd": "/"}, 1, "fds"),
    ],
)
def test_a_malformed_request_is_refused(request_, fds, error):
    with pytest.raises(protocol.ProtocolError, match=error):
        protocol.valid_request(request_, list(range(fds)))


@pytest.mark.parametrize("frame", [b"\xff\xff\xff\xff", b"\x00\x00\x00\x03abc", b"\x00\x00\x00\x02[]", b"\x00\x00"])
def test_a_malformed_message_is_a_protocol_error(frame):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(protocol.ProtocolError):
            protocol.recv_message(b)


def test_socket_path_is_short_and_per_job_host_and_etcd(sockdir):
    etcds = ("", "http://10.0.0.1:2379", "http://10.0.0.2:2379")
    paths = {protocol.socket_path(j, h, e) for j in ("a", "b") for h in ("h1", "h2") for e in etcds}
    assert len(paths) == 12 and all(len(str(p)) < 100 for p in paths)
    two = "http://10.0.0.1:2379,http://10.0.0.2:2379"
    assert protocol.socket_path("a", "h1", two) == protocol.socket_path(
        "a", "h1", "http://10.0.0.2:2379/, http://10.0.0.1:2379"
    )
    assert protocol.socket_path("a", "h1", two, "/elastictrain/") == protocol.socket_path("a", "h1", two)
    assert protocol.socket_path("a", "h1", two, "/other") != protocol.socket_path("a", "h1", two)


def test_the_agents_zygote_listens_where_the_launchs_workers_look(tmp_path):
    """The agent names its etcd and prefix to its zygote; launch names them to horovodrun, so to every client."""
    from elastictrain.commands import launch_env, zygote_command

    opts = LaunchOptions(config=tmp_path / "job.yaml")
    for prefix in ("/elastictrain", "/team-a"):
        env = launch_env(opts, etcd="http://127.0.0.1:2379", job="j", attempt=0, run_dir=tmp_path, prefix=prefix)
        cmd = zygote_command("job.yaml", (), job="j", host="h", etcd="http://127.0.0.1:2379", prefix=prefix)
        flags = dict(zip(cmd[-8::2], cmd[-7::2], strict=True))
        served = protocol.socket_path(flags["--job"], flags["--host"], flags["--etcd"], flags["--prefix"])
        assert served == protocol.client_socket_path({**env, "HOROVOD_HOSTNAME": "h"}), prefix


def test_launch_runs_workers_through_the_client_with_hot_join(tmp_path):
    cfg = tmp_path / "job.yaml"
    cold = worker_command(LaunchOptions(config=cfg, overrides=("a=1",), hot_join=False))
    hot = worker_command(LaunchOptions(config=cfg, overrides=("a=1",)))  # hot join is the default
    assert hot[1:4] == ["-m", "elastictrain.hotjoin.client", "--"] and hot[4:] == cold
    assert runs_train(cold) and runs_train(hot)


def test_a_warm_zygote_has_one_thread_and_no_mlflow(procs, sockdir):
    proc = procs.start(
        [
            sys.executable,
            "-m",
            "elastictrain.cli",
            "zygote",
            "serve",
            "--config",
            "configs/demo.yaml",
            "--job",
            "job1",
            "--host",
            "h1",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith(protocol.READY_LINE)
    assert len(os.listdir(f"/proc/{proc.pid}/task")) == 1
    maps = Path(f"/proc/{proc.pid}/maps").read_text()
    assert "libtorch" in maps and "horovod" in maps  # warm: torch and Horovod are loaded
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_warm_imports_what_a_workers_first_optimizer_and_first_image_import_lazily_and_keeps_one_thread():
    code = (
        "import os, sys; from elastictrain.hotjoin import server as zygote; zygote.warm('configs/demo.yaml', []);"
        "print('torch._dynamo' in sys.modules, 'torchvision.datasets.folder' in sys.modules,"
        " 'PIL.PngImagePlugin' in sys.modules, len(os.listdir('/proc/self/task')))"
    )
    env = {**{k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True", "True", "1"], out.stderr[-2000:]


def raw_request(*args: str) -> dict[str, object]:
    """A request as a client of the stand-in zygote (:data:`SERVER`) sends it, with the Python of that client."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return {
        "args": list(args),
        "env": env,
        "cwd": "/",
        "prefix": sys.prefix,
        "path0": "",
        "path": json.loads(out.stdout),
    }


def test_a_worker_forked_for_a_client_that_already_left_does_not_stay(server, sockdir):
    """A client that gave up (and started its worker cold) must not leave a warm twin running."""
    path = protocol.socket_path("job1", "h1")
    for _ in range(3):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(path))
            null = os.open(os.devnull, os.O_RDWR)  # streams that stay writable: the worker itself would live on
            protocol.send_message(s, raw_request("wait"), [null, null, null])
            os.close(null)
    wait_until(lambda: not [c for c in worker_children(server) if c.status() != psutil.STATUS_ZOMBIE], 30,
               what="no worker left for the clients that left")  # fmt: skip
    assert server.poll() is None, "the zygote survives bad clients"


def test_the_client_never_talks_to_a_socket_in_a_folder_others_could_write(procs, sockdir):
    sockdir.mkdir(mode=0o777)
    os.chmod(sockdir, 0o777)
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    impostor.bind(str(protocol.socket_path("job1", "h1")))
    impostor.listen(1)
    try:
        c = start_client(procs, "5")
        out, _ = c.communicate(timeout=60)
        assert (c.returncode, out.strip()) == (0, "cold train 5")
    finally:
        impostor.close()


def test_a_second_zygote_on_a_live_socket_is_refused_and_a_stale_socket_is_replaced(server, sockdir):
    path = protocol.socket_path("job1", "h1")
    with pytest.raises(FileExistsError):
        zygote.listen(path)
    stale = sockdir.parent / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # a socket file nobody listens on, as a SIGKILLed zygote leaves
    zygote.listen(stale).close()


def test_the_agent_sees_the_ready_line_behind_other_output(tmp_path):
    from discovery.agent import Signals, start_zygote

    class Log:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def info(self, msg: str, **_: object) -> None:
            self.lines.append(msg)

        warning = info

    script = (
        "import sys, time; print('a task printed this'); print('zygote ready x'); sys.stdout.flush(); time.sleep(60)"
    )
    log = Log()
    proc = start_zygote([sys.executable, "-c", script], 120, Signals(), log)
    try:
        assert proc is not None and log.lines == ["warm worker process ready"]
        assert os.getsid(proc.pid) == proc.pid, "the zygote runs in its own session"
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def test_the_code_stamp_names_a_changed_or_removed_file_of_the_code_it_watched(tmp_path, monkeypatch):
    import importlib

    pkg = tmp_path / "usertask_stamp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text("VERSION = 1\n")
    config = tmp_path / "job.yaml"
    config.write_text("job: j\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("usertask_stamp.model")
    try:
        stamp = zygote.CodeStamp.take(packages=("usertask_stamp",), extra=(str(config),))
        assert str((pkg / "model.py").resolve()) in stamp.files
        assert any(f.endswith("elastictrain/hotjoin/server.py") for f in stamp.files), (
            "elastictrain's own code is watched"
        )
        assert not any("/site-packages/torch/" in f for f in stamp.files), "installed packages are not"
        assert stamp.changed() is None
        (pkg / "model.py").write_text("VERSION = 22\n")
        assert stamp.changed() == str((pkg / "model.py").resolve())
        (pkg / "model.py").write_text("VERSION = 1\n")
        os.utime(pkg / "model.py", ns=(stamp.files[str((pkg / "model.py").resolve())][0],) * 2)
        assert stamp.changed() is None, "the same size and mtime: unchanged"
        config.unlink()
        assert stamp.changed() == str(config.resolve())
    finally:
        for name in [n for n in sys.modules if n.startswith("usertask_stamp")]:
            del sys.modules[name]


def real_zygote(procs: ProcessGroup, folder: Path, task: str, *, mtime_ns: int | None = None) -> subprocess.Popen:
    """``elastictrain zygote serve`` for job1 on h1, warming a config in ``folder`` whose task is ``task`` (with
    ``mtime_ns``, every file in ``folder`` gets that mtime first)."""
    (folder / "job.yaml").write_text(f"job: job1\nrun_dir: run\ntask: {task}\n")
    for f in folder.iterdir() if mtime_ns is not None else ():
        os.utime(f, ns=(mtime_ns, mtime_ns))
    proc = procs.start(
        [sys.executable, "-m", "elastictrain.cli", "zygote", "serve", "--config", "job.yaml", "--job", "job1",
         "--host", "h1"],
        cwd=folder, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    return proc


def test_a_zygote_whose_task_code_changed_forks_nothing_of_the_old_code_and_restarts_itself_warm(
    procs, sockdir, tmp_path
):
    (tmp_path / "upgraded_task.py").write_text("VERSION = 1\n\ndef build():\n    raise NotImplementedError\n")
    proc = real_zygote(procs, tmp_path, "upgraded_task:build")
    first = proc.stdout.readline()
    assert first.startswith(protocol.READY_LINE), first
    (tmp_path / "upgraded_task.py").write_text("VERSION = 2\n\ndef build():\n    raise NotImplementedError\n")
    c = start_client(procs, "x")
    out, _ = c.communicate(timeout=60)
    said = []  # what the zygote said until it was ready again
    while not (line := proc.stdout.readline()).startswith(protocol.READY_LINE):
        assert line, f"the zygote ended: {said}"
        said.append(line)
    assert any("upgraded_task.py changed since it warmed; restarting" in x for x in said), said
    assert not any("forked worker" in x for x in said), "no worker is forked from the old code"
    assert line.split()[-1] == str(proc.pid), line  # the same process, re-executed: warm again, with the new code
    if not out.startswith("cold "):  # the client came while the new code warmed, waited, and was forked from it
        assert "forked worker" in proc.stdout.readline()
    assert proc.poll() is None


def test_the_forked_worker_of_a_client_is_found_by_the_streams_it_was_handed(server, procs):
    from elastictrain.launcher.processes import forked_worker

    c = start_client(procs, "wait")
    other = start_client(procs, "wait")
    assert c.stdout is not None and c.stdout.readline().startswith("worker ")
    assert other.stdout is not None and other.stdout.readline().startswith("worker ")
    everyone = list(psutil.process_iter())
    found = forked_worker(psutil.Process(c.pid), everyone)
    assert found is not None and found.ppid() == server.pid
    assert forked_worker(psutil.Process(other.pid), everyone).pid not in (found.pid, other.pid)
    found.suspend()  # what chaos's freeze-worker does: the training process stops, not only its client
    wait_until(lambda: found.status() == psutil.STATUS_STOPPED, 10, what="the forked worker stopped")
    found.resume()
    c.send_signal(signal.SIGTERM)
    assert c.wait(timeout=60) == 143


STAMPED_SERVER = SERVER.replace(
    "z = zygote.Zygote(zygote.listen(path), path)",
    "z = zygote.Zygote(zygote.listen(path), path, zygote.CodeStamp.take(extra=(sys.argv[1],)))",
)


@pytest.mark.parametrize("sigterm", [False, True], ids=["restarts", "sigterm-wins"])
def test_a_stale_zygote_lets_its_running_worker_finish_then_restarts_unless_told_to_stop(
    procs, sockdir, tmp_path, sigterm
):
    watched = tmp_path / "task.py"
    watched.write_text("VERSION = 1\n")
    server = procs.start(
        [sys.executable, "-c", STAMPED_SERVER, str(watched)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert server.stdout is not None and server.stdout.readline().startswith(protocol.READY_LINE)
    running = start_client(procs, "wait")
    assert running.stdout is not None and running.stdout.readline().startswith("worker ")
    watched.write_text("VERSION = 22\n")
    line = server.stdout.readline()
    assert "forked worker" in line or "changed since it warmed" in line, line
    if "forked worker" in line:
        line = server.stdout.readline()
    assert "task.py changed since it warmed; restarting once its workers have exited" in line, line
    late = start_client(procs, "1")
    out, _ = late.communicate(timeout=30)
    assert out.startswith("cold "), "a stale zygote takes no request"
    assert server.poll() is None, "it waits for its running worker"
    if sigterm:
        server.send_signal(signal.SIGTERM)
    running.send_signal(signal.SIGTERM)
    assert running.wait(timeout=30) == 143
    assert server.wait(timeout=30) == (0 if sigterm else zygote.RESTART & 0xFF)


def test_a_file_edited_after_the_zygote_read_it_counts_as_changed_whatever_its_mtime(tmp_path, monkeypatch):
    """Edited while the zygote still warmed: the stamp is what the import read, not what the disk holds later."""
    import importlib
    import time

    module, config = tmp_path / "stamped_mod.py", tmp_path / "job.yaml"
    module.write_text("VERSION = 1\n")
    config.write_text("job: j\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    zygote.record_reads()
    try:
        importlib.import_module("stamped_mod")
        zygote.note_read(str(config))
        past = time.time_ns() - 3600 * 10**9  # edited, then given an older mtime (a copy that keeps timestamps)
        for f, text in ((module, "VERSION = 2\n"), (config, "job: k\n")):
            f.write_text(text)  # the same size: only the mtime tells
            os.utime(f, ns=(past, past))
        stamp = zygote.CodeStamp.take(packages=("stamped_mod",), extra=(str(config),))
        assert stamp.files[str(module.resolve())] != zygote._stat(str(module))
        assert stamp.changed() in (str(module.resolve()), str(config.resolve()))
        module.unlink()
        assert stamp.changed() is not None
    finally:
        zygote.stop_recording()
        sys.modules.pop("stamped_mod", None)


def test_restarts_in_a_row_back_off_and_a_zygote_that_served_a_while_restarts_at_once():
    assert [zygote.restart_delay(n) for n in range(8)] == [0, 2, 4, 8, 16, 32, 60, 60]
    assert zygote.restarts_in_a_row(3, served_seconds=1.0) == 3
    assert zygote.restarts_in_a_row(3, served_seconds=zygote.RESTART_RESET_SECONDS) == 0


def test_a_zygote_whose_changed_code_does_not_warm_yet_tries_again_and_recovers(procs, sockdir, tmp_path):
    good = "def build():\n    raise NotImplementedError\n"
    (tmp_path / "flaky_task.py").write_text(good)
    proc = real_zygote(procs, tmp_path, "flaky_task:build")
    assert proc.stdout.readline().startswith(protocol.READY_LINE)
    (tmp_path / "flaky_task.py").write_text("def build(:\n")  # a half-saved edit
    assert "changed since it warmed; restarting" in proc.stdout.readline()
    line = proc.stdout.readline()
    assert "warming the changed code failed" in line and "trying again in 2s" in line, line
    assert protocol.warming_since(protocol.socket_path("job1", "h1")) is None, "no client waits for a failed warm-up"
    (tmp_path / "flaky_task.py").write_text(good + "# fixed\n")
    again = proc.stdout.readline()  # the retry re-executes the same process, which warms the fixed code
    assert again.startswith(protocol.READY_LINE) and again.split()[-1] == str(proc.pid), again
    assert not protocol.warming_path(protocol.socket_path("job1", "h1")).exists(), "the marker goes once it listens"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


JOB_SERVER = SERVER.replace(
    "z = zygote.Zygote(zygote.listen(path), path)",
    "z = zygote.Zygote(zygote.listen(path), path, None, zygote.JobSpec.of(sys.argv[1], ['a=1']))",
)


def test_a_zygote_forks_only_for_the_config_and_overrides_it_warmed(procs, sockdir, tmp_path):
    """Two jobs of one name on one host share the socket path; the other job's worker must start cold."""
    mine = tmp_path / "job.yaml"
    server = procs.start(
        [sys.executable, "-c", JOB_SERVER, str(mine)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert server.stdout is not None and server.stdout.readline().startswith(protocol.READY_LINE)
    ours = start_client(procs, "3", "--config", "job.yaml", "--set", "a=1", cwd=tmp_path)
    assert ours.communicate(timeout=30)[0].startswith("worker ") and ours.returncode == 3
    for args in (("3", "--config", "other.yaml", "--set", "a=1"), ("3", "--config", "job.yaml", "--set", "a=2")):
        theirs = start_client(procs, *args, cwd=tmp_path)
        out, err = theirs.communicate(timeout=30)
        assert out.startswith("cold ") and "this zygote warmed" in err, (out, err)


WARMING_SERVER = SERVER.replace(
    "z = zygote.Zygote(zygote.listen(path), path)",
    "mark = protocol.mark_warming(path)\n"
    "print('warming', flush=True)\n"
    "sys.stdin.readline()  # warm until the test says\n"
    "listener = zygote.listen(path)\n"
    "protocol.unmark_warming(path, mark)\n"
    "z = zygote.Zygote(listener, path)",
)
assert WARMING_SERVER != SERVER


def warming_zygote(procs: ProcessGroup) -> subprocess.Popen:
    proc = procs.start(
        [sys.executable, "-c", WARMING_SERVER],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "warming"
    return proc


def waiting_client(procs: ProcessGroup, zygote_pid: int) -> subprocess.Popen:
    c = start_client(procs, "3")
    assert c.stderr is not None
    said = c.stderr.readline()
    assert f"waiting for the warming zygote (pid {zygote_pid})" in said, said
    return c


def test_a_client_that_comes_while_its_zygote_warms_waits_for_it_and_gets_a_warm_worker(procs, sockdir):
    server = warming_zygote(procs)
    c = waiting_client(procs, server.pid)
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write("go\n")
    server.stdin.flush()
    assert server.stdout.readline().startswith(protocol.READY_LINE)
    out, err = c.communicate(timeout=60)
    assert c.returncode == 3, err
    assert out.split(" ")[:2] == ["worker", str(server.pid)], "forked by the zygote it waited for, not cold"
    assert not protocol.warming_path(protocol.socket_path("job1", "h1")).exists(), "the marker goes once it listens"


def test_a_client_whose_warming_zygote_dies_starts_cold(procs, sockdir):
    server = warming_zygote(procs)
    c = waiting_client(procs, server.pid)
    server.kill()  # not reaped: a zygote whose agent has not waited for it yet is a zombie
    out, _ = c.communicate(timeout=protocol.WARMING_WAIT_SECONDS / 2)
    assert (c.returncode, out.strip()) == (0, "cold train 3")


def test_a_signal_to_a_waiting_client_ends_it_with_that_signal_and_starts_nothing(procs, sockdir):
    server = warming_zygote(procs)
    c = waiting_client(procs, server.pid)
    c.send_signal(signal.SIGTERM)
    out, _ = c.communicate(timeout=protocol.WARMING_WAIT_SECONDS / 2)
    assert (c.returncode, out) == (-signal.SIGTERM, "")


def test_a_client_waits_for_a_warm_up_only_until_the_bound_after_it_began(sockdir, monkeypatch):
    path = protocol.socket_path("job1", "h1")
    mark = protocol.mark_warming(path)
    assert mark is not None
    pid, started, since = mark.split()
    relay = types.SimpleNamespace(pending=[])
    protocol.warming_path(path).write_text(f"{pid} {started} {float(since) - protocol.WARMING_WAIT_SECONDS}")
    with pytest.raises(FileNotFoundError):  # warming for longer than the bound: cold at once
        client._connect(path, relay)
    monkeypatch.setattr(client, "WARMING_WAIT_SECONDS", 0.3)
    protocol.warming_path(path).write_text(mark)
    with pytest.raises(FileNotFoundError):  # still warming when the bound passes: cold
        client._connect(path, relay)


def test_a_warming_marker_counts_only_while_the_process_it_names_runs(sockdir):
    path = protocol.socket_path("job1", "h1")
    assert protocol.warming_since(path) is None  # no marker
    mark = protocol.mark_warming(path)
    assert mark is not None
    assert protocol.warming_since(path) == (os.getpid(), float(mark.split()[2]))
    pid, started, since = mark.split()
    marker = protocol.warming_path(path)
    for other in (f"{pid} {int(started) + 1} {since}", f"999999999 1 {since}", f"{pid} {started} nan", "x y z", ""):
        marker.write_text(other)  # a reused pid, no such process, garbage
        assert protocol.warming_since(path) is None, other
    protocol.unmark_warming(path, mark)
    assert marker.exists(), "a marker another process wrote is left alone"
    marker.write_text(mark)
    protocol.unmark_warming(path, mark)
    assert not marker.exists()


def test_warm_ups_take_the_machines_slots_one_each_and_go_ahead_without_one_after_the_wait(tmp_path):
    with zygote.warm_slot(tmp_path, 2, 0) as first, zygote.warm_slot(tmp_path, 2, 0) as second:
        assert first and second
        with zygote.warm_slot(tmp_path, 2, 0.2) as third:  # every slot held: after the wait it warms anyway
            assert not third
    with zygote.warm_slot(tmp_path, 1, 0) as again:  # released when the block ends
        assert again


def test_a_dead_warm_up_frees_its_slot(procs, tmp_path):
    holder = procs.start(
        [sys.executable, "-c", "import sys\nfrom pathlib import Path\n"
         "from elastictrain.hotjoin.server import warm_slot\n"
         "with warm_slot(Path(sys.argv[1]), 1, 0) as got:\n    print(got, flush=True)\n    sys.stdin.read()",
         str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "True"
    with zygote.warm_slot(tmp_path, 1, 0) as got:
        assert not got, "the other process holds the only slot"
    holder.kill()
    holder.wait(timeout=10)
    with zygote.warm_slot(tmp_path, 1, 0) as got:
        assert got


def test_a_warm_up_whose_slot_files_cannot_be_opened_goes_ahead_without_a_slot(tmp_path):
    with zygote.warm_slot(tmp_path / "missing", 2, 60) as got:  # no such folder: no slot (it raised before)
        assert not got


# -- a zygote that restarts forever (issue 37, item 4)


def test_a_zygote_whose_files_have_future_mtimes_serves_instead_of_restarting(procs, sockdir, tmp_path):
    """An NFS server whose clock is ahead, or a tarball's timestamps: an unchanged file is not a change."""
    import time

    (tmp_path / "future_task.py").write_text("def build():\n    raise NotImplementedError\n")
    proc = real_zygote(procs, tmp_path, "future_task:build", mtime_ns=time.time_ns() + 3600 * 10**9)
    first = proc.stdout.readline()
    assert first.startswith(protocol.READY_LINE), first
    c = start_client(procs, "--config", "job.yaml", cwd=tmp_path)
    _, err = c.communicate(timeout=60)
    assert "starting cold" not in err, err
    line = proc.stdout.readline()
    assert "forked worker" in line, f"the zygote did not serve: {line!r}"


# -- one client at a time (issue 37, item 5)

SLOW_SERVER = SERVER.replace(
    "path = protocol.socket_path",
    "protocol.CONNECT_TIMEOUT_SECONDS = protocol.ANSWER_SECONDS = 60.0  # a silent connection is held a long time\n"
    "path = protocol.socket_path",
)


@pytest.fixture
def slow_server(procs, sockdir) -> subprocess.Popen:
    proc = procs.start(
        [sys.executable, "-c", SLOW_SERVER], env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().startswith(protocol.READY_LINE)
    return proc


def silent_connection() -> socket.socket:
    """A connection to the zygote of job1 on h1 that sends nothing (a client stopped right after connect)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(protocol.socket_path("job1", "h1")))
    return s


def test_a_silent_connection_does_not_hold_up_another_client(slow_server, procs):
    with silent_connection(), silent_connection():
        c = start_client(procs, "3")
        out, err = c.communicate(timeout=60)
    assert (c.returncode, out.split(" ")[:2]) == (3, ["worker", str(slow_server.pid)]), (out, err)


def test_a_dead_clients_worker_is_killed_while_another_connection_is_silent(slow_server, procs):
    from elastictrain.launcher.processes import forked_worker

    c = start_client(procs, "wait")
    assert c.stdout is not None and c.stdout.readline().startswith("worker ")
    worker = forked_worker(psutil.Process(c.pid), worker_children(slow_server))
    assert worker is not None
    with silent_connection():
        c.kill()
        c.wait(timeout=10)
        wait_until(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 20, what="worker gone")


HANGING_CHECK_SERVER = STAMPED_SERVER.replace(
    "worker.main = stand_in",
    "worker.main = stand_in\n"
    "import time\n"
    "_changed = zygote.CodeStamp.changed\n"
    "def changed(self):\n"
    "    if os.path.exists(sys.argv[2]):  # from now on a stat never returns (a hung network file system)\n"
    "        open(sys.argv[3], 'w').close()\n"
    "        time.sleep(3600)\n"
    "    return _changed(self)\n"
    "zygote.CodeStamp.changed = changed",
)
assert HANGING_CHECK_SERVER != STAMPED_SERVER


def test_a_hung_code_check_neither_stops_reaping_nor_leaves_a_client_waiting(procs, sockdir, tmp_path):
    from elastictrain.launcher.processes import forked_worker

    watched, hang, hanging = tmp_path / "task.py", tmp_path / "hang", tmp_path / "hanging"
    watched.write_text("VERSION = 1\n")
    server = procs.start(
        [sys.executable, "-c", HANGING_CHECK_SERVER, str(watched), str(hang), str(hanging)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert server.stdout is not None and server.stdout.readline().startswith(protocol.READY_LINE)
    c = start_client(procs, "wait")
    assert c.stdout is not None and c.stdout.readline().startswith("worker ")
    worker = forked_worker(psutil.Process(c.pid), worker_children(server))
    assert worker is not None
    hang.touch()
    wait_until(hanging.exists, 30, what="a code check that hangs")
    c.kill()
    c.wait(timeout=10)
    wait_until(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 20, what="worker gone")
    late = start_client(procs, "1")
    out, err = late.communicate(timeout=60)
    assert out.startswith("cold ") and "check" in err, (out, err)
    assert server.poll() is None


# -- a signal lost right after fork (issue 37, item 6)

EARLY_SIGNAL_SERVER = SERVER.replace(
    "worker.main = stand_in",
    "worker.main = stand_in\n"
    "_die_with = zygote._die_with\n"
    "def die_with_then_sigterm(parent):  # the first thing a forked worker does: a SIGTERM arrives meanwhile\n"
    "    _die_with(parent)\n"
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
    "zygote._die_with = die_with_then_sigterm",
)
assert EARLY_SIGNAL_SERVER != SERVER


def test_a_sigterm_that_reaches_a_worker_before_it_set_its_handlers_ends_it(procs, sockdir):
    server = procs.start(
        [sys.executable, "-c", EARLY_SIGNAL_SERVER], env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert server.stdout is not None and server.stdout.readline().startswith(protocol.READY_LINE)
    c = start_client(procs, "wait")
    try:
        out, _ = c.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the SIGTERM was lost: the forked worker runs on")
    assert (c.returncode, out) == (-signal.SIGTERM, "")


# -- hot-joined workers in the client's environment, one zygote per job (issue 37, item 11)


@pytest.mark.parametrize(
    ("name", "value"), [("OPENBLAS_CORETYPE", "Haswell"), ("PYTHONPATH", f"{REPO}{os.pathsep}/zt-elsewhere")]
)
def test_a_client_whose_start_up_environment_differs_from_the_zygotes_starts_cold(server, procs, name, value):
    c = start_client(procs, "3", **{name: value})
    out, err = c.communicate(timeout=60)
    assert (c.returncode, out.strip()) == (0, "cold train 3"), (out, err)
    assert "starting cold" in err and ("sys.path" if name == "PYTHONPATH" else name) in err, err


THREADS_SERVER = SERVER.replace(
    "import os, signal, sys\n",
    "import os, signal, sys\n"
    "for name in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'GOTO_NUM_THREADS'):\n"
    "    os.environ.pop(name, None)\n"
    "os.environ['OPENBLAS_NUM_THREADS'] = '1'  # as the zygote warms: OpenBLAS would start its threads at import\n"
    "import numpy, torch\n",
).replace(
    'print("worker"',
    'print("threads", torch.get_num_threads(), len(os.listdir("/proc/self/task")), flush=True)\n    print("worker"',
)
assert THREADS_SERVER.count("threads") >= 2

THREADS_PROBE = "import os, numpy, torch; print('threads', torch.get_num_threads(), len(os.listdir('/proc/self/task')))"


@pytest.mark.parametrize("threads", [{}, {"OMP_NUM_THREADS": "1"}], ids=["default", "OMP_NUM_THREADS=1"])
def test_a_forked_worker_runs_torch_and_blas_on_the_threads_a_cold_worker_would(procs, sockdir, threads):
    server = procs.start(
        [sys.executable, "-c", THREADS_SERVER], env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert server.stdout is not None and server.stdout.readline().startswith(protocol.READY_LINE)
    env = {k: v for k, v in client_env(**threads).items() if not k.endswith("_NUM_THREADS") or k in threads}
    cold = subprocess.run([sys.executable, "-c", THREADS_PROBE], env=env, capture_output=True, text=True, timeout=120)
    c = procs.start(
        [sys.executable, "-m", "elastictrain.hotjoin.client", "--", sys.executable, "-c", "", "train", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = c.communicate(timeout=60)
    assert c.returncode == 0 and "worker" in out, (out, err)
    assert out.splitlines()[0] == cold.stdout.strip(), f"forked {out.splitlines()[0]!r}, cold {cold.stdout.strip()!r}"


def test_a_client_of_another_job_of_the_same_name_and_host_is_not_served(server, procs):
    """Two launches of one config on one machine (each with its etcd): neither's workers come from the other's zygote,
    whose agent stopping would kill them."""
    c = start_client(procs, "3", ELASTICTRAIN_ETCD="http://127.0.0.1:1")
    out, err = c.communicate(timeout=60)
    assert (c.returncode, out.strip()) == (0, "cold train 3"), (out, err)
