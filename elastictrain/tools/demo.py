"""``make demo`` (``python -m elastictrain.tools.demo``): a real elastic job on this machine, with faults, in minutes.

1. writes scikit-learn's 8x8 handwritten digits as an ImageFolder of PNG files under ``run_dir/data``;
2. runs ``elastictrain launch --config configs/digits.yaml`` with the embedded etcd and agents for two
   logical hosts of this machine (``localhost``, ``127.0.0.1``);
3. injects faults, each once the job has reacted to the previous one (polling ``events.jsonl`` with
   deadlines): a third agent joins (2 -> 3 workers); one worker is killed with SIGKILL (found by its
   environment: the launcher's ``ELASTICTRAIN_LAUNCH_ID`` and ``HOROVOD_HOSTNAME``, never by name);
   Horovod recovers and, after the blacklist cooldown, grows back to 3; the third host is drained
   (SIGTERM to its agent: a spot-instance notice) and the job shrinks gracefully to 2;
4. prints a summary: test accuracy, resets and why, recovery seconds, the scale-up pauses (hot join, the
   launcher's default: the third agent keeps a warm zygote too), checkpoint stall, goodput, the timeline PNG
   (``elastictrain report``) and the ``mlflow ui`` command.

Exit code: the launcher's (0 when training completed), or 1 when a phase missed its deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from elastictrain import envnames
from elastictrain.cliutil import OneLineParser
from elastictrain.commands import agent_command, elastictrain_command
from elastictrain.config import ConfigError, JobConfig, load_config
from elastictrain.errors import ToolError
from elastictrain.launcher.hosts import local_logical_hosts
from elastictrain.launcher.processes import is_worker
from elastictrain.rundir import layout
from elastictrain.rundir.events import Commit, EpochEnd, Event, Reset, Start, of_kind, read_events

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "configs" / "digits.yaml"


class DemoError(ToolError, RuntimeError):
    """A phase of the demo did not happen in time; the message says which."""


class Demo:
    def __init__(self, cfg: JobConfig, config_path: Path, hosts: list[str]) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.hosts = hosts
        self.run_dir = cfg.run_path.resolve()
        self.events_path = self.run_dir / layout.EVENTS
        self.t0 = time.monotonic()
        self.launcher: subprocess.Popen[bytes] | None = None
        self.extra_agent: subprocess.Popen[bytes] | None = None
        self.log_path = self.run_dir / "logs" / "launch.log"

    # -- output
    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)

    # -- polling
    def events(self) -> list[Event]:
        try:
            return read_events(self.events_path)
        except FileNotFoundError:
            return []

    def wait_for(self, what: str, predicate: Callable[[list[Event]], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate(self.events())
            if value:
                return value
            if self.launcher is not None and self.launcher.poll() is not None:
                raise DemoError(f"the launcher exited ({self.launcher.returncode}) while waiting for {what}")
            if time.monotonic() > deadline:
                raise DemoError(f"no {what} within {timeout:g}s; see {self.log_path}")
            time.sleep(0.2)

    def state(self) -> dict[str, Any]:
        def read(_: object) -> dict[str, Any] | None:
            with contextlib.suppress(OSError, ValueError):
                return dict(json.loads((self.run_dir / layout.LAUNCH_STATE).read_text()))
            return None

        return dict(self.wait_for("launcher state file", read, 60))

    # -- phases
    def prepare(self) -> None:
        from elastictrain.engine.data import write_digits_image_folder

        keep = self.run_dir / "data"
        if self.run_dir.exists():  # a fresh job each time (a complete checkpoint would make it finish at once)
            for child in self.run_dir.iterdir():
                if child != keep:
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        counts = write_digits_image_folder(keep)
        self.say(f"digits written as PNG files: {counts['train']} train, {counts['val']} test images under {keep}")
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def launch(self) -> None:
        cmd = elastictrain_command(
            "launch",
            "--config", str(self.config_path),
            "--hosts", ",".join(self.hosts[:2]),
            "--blacklist-cooldown-range", "1", "2",
            "--drain-grace", "5",
        )  # fmt: skip
        self.say("$ " + " ".join(["elastictrain", *cmd[1:]] if cmd[0].endswith("elastictrain") else cmd))
        self.say(f"launcher, horovodrun and worker output: {self.log_path}")
        env = {**os.environ, envnames.LOG_LEVEL: os.environ.get(envnames.LOG_LEVEL, "warning")}
        with self.log_path.open("ab") as log:
            self.launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path.cwd())

    def world(self, evs: list[Event]) -> int | None:
        sized = [e for e in evs if isinstance(e, Start | Reset)]
        return sized[-1].world_size if sized else None

    def run(self) -> int:
        self.prepare()
        self.launch()
        state = self.state()
        self.wait_for("start at 2 workers", lambda evs: self.world(evs) == 2, 90)
        self.say(f"training on 2 workers ({', '.join(self.hosts[:2])}); etcd {state['etcd']}")
        self.wait_for("steps", lambda evs: max((e.step for e in evs), default=0) >= 15, 60)

        third = self.hosts[2]
        self.extra_agent = self._start_agent(state, third)
        self.say(f"fault 1/3: a third host joins: agent for {third!r} (pid {self.extra_agent.pid})")
        self.wait_for("growth to 3 workers", lambda evs: self.world(evs) == 3, 90)
        self.say("grew to 3 workers")
        n = len(self.events())
        self.wait_for("steps at 3 workers", lambda evs: len(of_kind(evs[n:], Commit)) >= 2, 60)

        victim_host = self.hosts[1]
        victim = self._worker_on(state["launch_id"], victim_host)
        n = len(self.events())
        victim.kill()
        self.say(f"fault 2/3: SIGKILL to the worker on {victim_host!r} (pid {victim.pid})")
        self.wait_for(
            "recovery from the killed worker",
            lambda evs: any(e.reason == "worker_failed" for e in of_kind(evs[n:], Reset)),
            120,
        )
        self.say("recovered at 2 workers; the killed host returns after its blacklist cooldown")
        self.wait_for("growth back to 3 workers", lambda evs: self.world(evs[n:]) == 3, 90)
        self.say("back at 3 workers")
        n = len(self.events())
        self.wait_for("steps at 3 workers", lambda evs: len(of_kind(evs[n:], Commit)) >= 2, 60)

        self.extra_agent.send_signal(signal.SIGTERM)
        self.say(f"fault 3/3: host {third!r} drained (SIGTERM to its agent, like a spot-instance notice)")
        self.wait_for(
            "graceful shrink to 2 workers",
            lambda evs: any(e.new_size == 2 for e in of_kind(evs[n:], Reset)),
            90,
        )
        self.say("shrank to 2 workers; training to the end")
        assert self.launcher is not None
        code = self.launcher.wait(timeout=600)
        self.say(f"launcher exited {code}")
        return code

    def _start_agent(self, state: dict[str, Any], host: str) -> subprocess.Popen[bytes]:
        # Like the launcher's own agents (hot join is launch's default): a warm zygote, registered once it is warm.
        cmd = agent_command(
            self.cfg.discovery,
            etcd=state["etcd"],
            job=state["job"],
            host=host,
            drain_grace_seconds=5,
            warm_config=self.config_path.resolve(),
        )
        with (self.run_dir / "logs" / f"agent-{host}.log").open("ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _worker_on(self, launch_id: str, host: str) -> psutil.Process:
        """The worker process of this launch on logical host ``host``, found by its environment."""

        def find(_: object) -> psutil.Process | None:
            for p in psutil.process_iter():
                with contextlib.suppress(psutil.Error):
                    env = p.environ()
                    ours = env.get(envnames.LAUNCH_ID) == launch_id and env.get("HOROVOD_HOSTNAME") == host
                    if ours and is_worker(p):
                        return p
            return None

        proc: psutil.Process = self.wait_for(f"a worker on {host}", find, 30)
        return proc

    def cleanup(self) -> None:
        """Stop what the demo started, by pid: its extra agent, and the launcher if a phase failed."""
        if self.extra_agent is not None and self.extra_agent.poll() is None:
            self.extra_agent.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.extra_agent.wait(timeout=1)
            if self.extra_agent.poll() is None:
                self.extra_agent.send_signal(signal.SIGTERM)  # a second signal skips the drain grace
                try:
                    self.extra_agent.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.extra_agent.kill()
                    self.extra_agent.wait()
        if self.launcher is not None and self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGTERM)  # it stops its workers, agents and etcd
            try:
                self.launcher.wait(timeout=90)
            except subprocess.TimeoutExpired:
                for p in [*psutil.Process(self.launcher.pid).children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
                self.launcher.kill()
                self.launcher.wait()

    def summary(self) -> None:
        from elastictrain.rundir.report import report, summarize

        evs = self.events()
        s = summarize(evs)
        accs = [e.val_accuracy for e in of_kind(evs, EpochEnd) if e.val_accuracy is not None]
        acc = accs[-1] if accs else None
        print()
        print("=" * 78)
        print(f"demo summary ({self.cfg.job}, run_dir {self.run_dir})")
        print(f"  state                 {s['state']} at step {s['step']}, epoch {s['epoch']}")
        if acc is not None:
            held_out = f"{len(list((self.run_dir / 'data' / 'val').rglob('*.png')))} held-out digit images"
            print(f"  test accuracy         {acc:.1%} on {held_out}")
        print(f"  resets                {len(s['resets'])}")
        for i, r in enumerate(s["resets"], 1):
            rec = r["recovery_seconds"]
            print(
                f"    {i}. t={r['t']:6.1f}s  {r['reason']:<14} {r['old_size']} -> {r['new_size']} workers, "
                f"recovery {rec:.1f}s, {r['lost_steps']} steps rolled back"
                if rec is not None
                else f"    {i}. t={r['t']:6.1f}s  {r['reason']} {r['old_size']} -> {r['new_size']}"
            )
        rec, stall = s["recovery_seconds"], s["checkpoints"]["stall_seconds"]
        if rec["median"] is not None:
            print(f"  recovery seconds      median {rec['median']:.1f}, max {rec['max']:.1f}")
        ups = [r["recovery_seconds"] for r in s["resets"] if r["recovery_seconds"] is not None and _grew(r)]
        if ups:
            pauses = ", ".join(f"{p:.1f}s" for p in ups)
            print(f"  scale-up pause        {pauses} (hot join: new workers forked from a warm process per host)")
        if stall["median"] is not None:
            print(
                f"  checkpoint stall      median {stall['median'] * 1000:.0f} ms, max {stall['max'] * 1000:.0f} ms "
                f"over {s['checkpoints']['count']} checkpoints (written in the background)"
            )
        if s["goodput"] is not None:
            print(
                f"  goodput               {s['goodput']:.1%} ({s['productive_seconds']:.1f}s of kept steps "
                f"in {s['wall_seconds']:.1f}s wall)"
            )
        try:
            png = report(self.run_dir)["png"]
            print(f"  timeline              {png}   (elastictrain report --run-dir {self.run_dir})")
        except Exception as e:  # the PNG is a convenience; the summary above stands without it
            print(f"  timeline              not written ({type(e).__name__}: {e})")
        uri = f"sqlite:///{self.run_dir / layout.MLFLOW_DB}"
        if (self.run_dir / layout.MLFLOW_DB).exists():
            print(f"  MLflow                mlflow ui --backend-store-uri {uri}")
        print("=" * 78)


def _grew(reset: dict[str, Any]) -> bool:
    old, new = reset.get("old_size"), reset.get("new_size")
    return isinstance(old, int) and isinstance(new, int) and new > old


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m elastictrain.tools.demo", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(_relative(DEFAULT_CONFIG)), help="job config (default configs/digits.yaml)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"demo: config error: {e}", file=sys.stderr)
        return 2
    hosts = local_logical_hosts()
    if len(hosts) < 3:
        print(f"demo: needs 3 logical hosts on this machine, found {hosts}", file=sys.stderr)
        return 2
    demo = Demo(cfg, Path(args.config), hosts)
    code = 1
    try:
        code = demo.run()
    except DemoError as e:
        demo.say(f"demo failed: {e}")
    except KeyboardInterrupt:
        demo.say("interrupted")
        code = 130
    finally:
        demo.cleanup()
    if demo.events():
        demo.summary()
    demo.say(f"done in {time.monotonic() - demo.t0:.0f}s")
    return code


def _relative(path: Path) -> Path:
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


if __name__ == "__main__":
    sys.exit(main())
