"""``python -m elastictrain.hvdrun ARGS``: ``horovodrun ARGS`` with a host discovery that costs a fork, not a Python.

Horovod 0.28.1's elastic driver runs ``--host-discovery-script`` every second through
``safe_shell_exec.execute``, which starts a *spawned* multiprocessing middleman: a fresh Python
interpreter that re-imports the ``horovodrun`` script, every second, for the whole job. Measured on a
2-core machine: the driver then uses 13 % of a core against 1 % for a static ``horovodrun -np 2``, which
took 6-8 % off the throughput of two workers that share those cores.

This entry point is horovodrun itself (same flags, same driver, same rendezvous) with two repairs:

1. **Discovery by fork.** :func:`run_discovery_script` runs the script with ``subprocess`` in its own
   session, kills that session when the script outlives :data:`DISCOVERY_TIMEOUT_SECONDS`, and fails on a
   non-zero exit exactly as Horovod does (the driver fails the job on the first call and retries later
   ones). Parsing of the ``host:slots`` lines stays Horovod's.
2. **Dead slots are started again.** When the driver re-forms the job, it starts workers only for slots
   that were not in the previous assignment (``ElasticDriver._update_host_assignments``), whether or not
   the worker in that slot is still alive. A host whose worker died and that is discovered again before
   the next assignment (its blacklist cooldown ran out, as happens when the job fell below ``--min-np``
   and waited for hosts) therefore gets a rank but no process: the survivors wait in the rendezvous until
   the Gloo timeout, abort, and horovodrun then waits forever with no worker (seen in the chaos scenario
   ``below-min-np`` and a soak). :func:`install` makes the driver forget slots whose worker has exited
   before it computes the next assignment, so they are started again.

``elastictrain launch`` and the benchmarks start horovodrun this way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Any

DISCOVERY_TIMEOUT_SECONDS = 30.0
"""A discovery script that hangs this long is killed (with everything it started) and counts as failed."""


def run_discovery_script(script: str, timeout: float = DISCOVERY_TIMEOUT_SECONDS) -> str:
    """The stdout of ``script`` run by ``/bin/sh``; RuntimeError on a non-zero exit or a timeout.

    stderr goes to horovodrun's stderr, as with Horovod's own executor.
    """
    proc = subprocess.Popen(
        script, shell=True, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True, text=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"Failed to execute discovery script: {script}. Timed out after {timeout:g}s") from None
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"Failed to execute discovery script: {script}. Exit code: {proc.returncode}")
    return out


def install() -> None:
    """Apply both repairs to Horovod's runner classes (in this process). Idempotent."""
    from horovod.runner.elastic import discovery
    from horovod.runner.elastic.driver import ElasticDriver

    def _execute_discovery_script(self: discovery.HostDiscoveryScript) -> str:
        return run_discovery_script(self._discovery_script)

    discovery.HostDiscoveryScript._execute_discovery_script = _execute_discovery_script
    if getattr(ElasticDriver, "_elastictrain_repaired", False):
        return
    start_worker = ElasticDriver._start_worker_process
    worker_exit = ElasticDriver._handle_worker_exit
    update_assignments = ElasticDriver._update_host_assignments

    def exited(driver: Any) -> set[tuple[str, int]]:
        slots: set[tuple[str, int]] | None = getattr(driver, "_elastictrain_exited", None)
        if slots is None:
            slots = driver._elastictrain_exited = set()
        return slots

    def _start_worker_process(self: Any, slot_info: Any) -> Any:
        exited(self).discard((slot_info.hostname, slot_info.local_rank))
        return start_worker(self, slot_info)

    def _handle_worker_exit(self: Any, slot_info: Any, exit_code: int, timestamp: float) -> Any:
        # Recorded before Horovod's registry sees the exit, so before any re-assignment it can trigger.
        exited(self).add((slot_info.hostname, slot_info.local_rank))
        return worker_exit(self, slot_info, exit_code, timestamp)

    def _update_host_assignments(self: Any, current_hosts: Any) -> Any:
        gone = exited(self)
        if gone:
            live = {
                host: [s for s in slots if (host, s.local_rank) not in gone]
                for host, slots in self._host_assignments.items()
            }
            self._host_assignments = {host: slots for host, slots in live.items() if slots}
        return update_assignments(self, current_hosts)

    ElasticDriver._start_worker_process = _start_worker_process
    ElasticDriver._handle_worker_exit = _handle_worker_exit
    ElasticDriver._update_host_assignments = _update_host_assignments
    ElasticDriver._elastictrain_repaired = True


def main() -> int:
    install()
    from horovod.runner.launch import run_commandline

    sys.argv[0] = "horovodrun"
    run_commandline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
