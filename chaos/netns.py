"""Multi-node tier: each node a network namespace on a link-local bridge, running sshd and an agent.

Status: **TODO** (not built yet). Only the preflight is here, so that the tier skips with a clear
message instead of half-working. The plan, verified by hand on this kind of machine as root:

1. a bridge ``etbr0`` with ``169.254.77.1/24`` (link-local: nothing here is routed off the machine);
2. per node ``n``: ``ip netns add et-n<n>``; a veth pair ``etv<n>`` (bridge side) / ``eth0`` (inside)
   with ``169.254.77.<10+n>/24``; ``lo`` up; ``sshd -f <per-node config>`` inside the namespace,
   listening on that address only, host keys and an authorized key generated in the run dir;
3. an ``elastictrain agent --host 169.254.77.<10+n>`` inside each namespace against the launcher's
   etcd on the bridge address; ``elastictrain launch --etcd http://169.254.77.1:<port> -- -p <ssh port>``
   so horovodrun starts workers over ssh exactly as on a cluster (same filesystem, so the same venv);
4. faults become real: ``kill-host`` = kill everything in the namespace (``ip netns pids``),
   ``partition-host`` = ``ip link set etv<n> down`` (``python -m chaos partition-host``);
5. teardown in ``finally``: kill ``ip netns pids`` of each namespace by pid, ``ip netns del``, delete
   the bridge.

Requirements: root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), ``ip`` (iproute2) and ``sshd``
(openssh-server; ``scripts/setup.sh`` lists the apt package).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

SUBNET = "169.254.77.0/24"
"""Link-local: never routed beyond this machine."""


def sshd_binary() -> str | None:
    for candidate in (shutil.which("sshd"), "/usr/sbin/sshd"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def preflight() -> str | None:
    """None when the tier can run here; otherwise one line saying why it is skipped."""
    if shutil.which("ip") is None:
        return "multi-node chaos tier skipped: `ip` (iproute2) is not installed"
    if sshd_binary() is None:
        return "multi-node chaos tier skipped: sshd is not installed (apt-get install openssh-server)"
    if os.geteuid() != 0:
        return "multi-node chaos tier skipped: network namespaces need root"
    probe = f"etprobe-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10, check=False)
    if made.returncode != 0:
        return f"multi-node chaos tier skipped: network namespaces are not permitted here ({made.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10, check=False)
    return "multi-node chaos tier skipped: not built yet (TODO in chaos/netns.py; namespaces and sshd are available)"
