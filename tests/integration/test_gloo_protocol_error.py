"""Real Horovod: a Gloo message that a pair cannot place fails that pair's collectives, not the whole process.

When workers die in the middle of a collective (two at once, or rank 0 during the controller's exchange), a survivor
may receive a message from another survivor that is one step ahead or behind: its size does not match the
buffer posted (``op.preamble.length <= op.nbytes. 776 vs 8``) or no buffer is posted for it. Gloo's TCP pair
checks this with ``GLOO_ENFORCE`` on its device thread, where nothing catches it: ``std::terminate``, exit 134
(horovod/horovod#3264), one more worker lost to a fault that hit others, and at ``--min-np`` the whole ring waits
for hosts to come back. The Horovod patch (``elastictrain/horovod/patch.py``) turns it into an I/O error of that pair:
its pending collectives fail (``HorovodInternalError``) and the worker goes through a reset like any survivor.

The test makes the message: rank 1 of a two-rank job is stopped (its stream to rank 0 ends on a whole message:
Gloo writes each small message with one ``writev``), and a preamble for a slot that rank 0 never posted is written
into rank 1's own sockets to rank 0 (a duplicate taken with ``pidfd_getfd``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.fixtures.procs import REPO, VENV_BIN, kill_tree, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WORKER = REPO / "tests" / "integration" / "workers" / "gloo_pair.py"
SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture (syscalls from 424 on are shared)
SEND_UNBOUND_BUFFER = 1
"""``gloo::transport::tcp::Op::SEND_UNBOUND_BUFFER``."""


def preamble(slot: int, length: int) -> bytes:
    """A Gloo TCP message header (``Op::preamble``: nbytes, opcode, slot, offset, length, roffset; six size_t)."""
    return struct.pack("=6Q", 48 + length, SEND_UNBOUND_BUFFER, slot, 0, length, 0)


def write_into(pid: int, fd: int, data: bytes) -> None:
    """Write ``data`` into descriptor ``fd`` of process ``pid`` (a duplicate taken with ``pidfd_getfd``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError) as e:  # Linux before 5.3, or a kernel that refuses it
        pytest.skip(f"pidfd_open refused: {e}")
    try:
        dup = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if dup < 0:
            errno = ctypes.get_errno()
            pytest.skip(f"pidfd_getfd refused: {os.strerror(errno)}")
        try:
            os.write(dup, data)
        finally:
            os.close(dup)
    finally:
        os.close(pidfd)


def live(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_message_for_no_posted_buffer_fails_the_collective_not_the_process(tmp_path: Path) -> None:
    log = tmp_path / "horovodrun.log"
    cmd = [str(VENV_BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", "--network-interfaces", "lo"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*cmd, sys.executable, str(WORKER), str(tmp_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    stopped = None
    try:
        ready = [tmp_path / f"rank{r}.ready" for r in (0, 1)]
        wait_until(lambda: all(p.exists() for p in ready) or proc.poll() is not None, 120, what="both ranks ready")
        assert proc.poll() is None, log.read_text()[-3000:]
        pid0, pid1 = (int(p.read_text()) for p in ready)
        rank0_ends = {c.laddr for c in psutil.Process(pid0).net_connections("tcp") if c.status == "ESTABLISHED"}
        stopped = psutil.Process(pid1)
        stopped.suspend()
        to_rank0 = [c.fd for c in stopped.net_connections("tcp") if c.status == "ESTABLISHED" and c.raddr in rank0_ends]
        assert to_rank0, "rank 1 has no connection to rank 0"
        for fd in to_rank0:
            write_into(pid1, fd, preamble(slot=0x7E1A_5710, length=8) + bytes(8))
        error = tmp_path / "rank0.error"
        wait_until(lambda: error.exists() or not live(pid0), 60, what="rank 0's collective to fail")
        assert error.exists(), f"rank 0 died instead of failing its collective:\n{log.read_text()[-3000:]}"
        # Horovod's background loop prints why it failed (the worker's HorovodInternalError says only that it did)
        assert "Gloo protocol error" in log.read_text(), log.read_text()[-3000:]
    finally:
        if stopped is not None:
            with contextlib.suppress(psutil.Error):
                stopped.kill()
        kill_tree(proc.pid)
        proc.wait(timeout=30)
