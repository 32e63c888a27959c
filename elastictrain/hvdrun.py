"""``python -m elastictrain.hvdrun ARGS``: ``horovodrun ARGS`` with a host discovery that costs a fork, not a Python.

Horovod 0.28.1's elastic driver runs ``--host-discovery-script`` every second through
``safe_shell_exec.execute``, which starts a *spawned* multiprocessing middleman: a fresh Python
interpreter that re-imports the ``horovodrun`` script, every second, for the whole job. Measured on a
2-core machine: the driver then uses 13 % of a core against 1 % for a static ``horovodrun -np 2``, which
took 6-8 % off the throughput of two workers that share those cores.

This entry point is horovodrun itself (same flags, same driver, same rendezvous) with one method
replaced: :func:`run_discovery_script` runs the script with ``subprocess`` in its own session, kills that
session when the script outlives :data:`DISCOVERY_TIMEOUT_SECONDS`, and fails on a non-zero exit exactly as
Horovod does (the driver fails the job on the first call and retries later ones). Parsing of the
``host:slots`` lines stays Horovod's. ``elastictrain launch`` and the benchmarks start horovodrun this way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

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
    """Make Horovod's ``HostDiscoveryScript`` use :func:`run_discovery_script` (in this process)."""
    from horovod.runner.elastic import discovery

    def _execute_discovery_script(self: discovery.HostDiscoveryScript) -> str:
        return run_discovery_script(self._discovery_script)

    discovery.HostDiscoveryScript._execute_discovery_script = _execute_discovery_script


def main() -> int:
    install()
    from horovod.runner.launch import run_commandline

    sys.argv[0] = "horovodrun"
    run_commandline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
