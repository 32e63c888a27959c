"""Is this agent's Kubernetes node being drained? Read from the node object on the API server.

``kubectl drain`` cordons the node (``spec.unschedulable: true``) and then evicts its pods, but it skips
DaemonSet pods, so the agent (a DaemonSet pod) never gets the SIGTERM that drains its host. The agent's
``--drain-when-cordoned NODE`` option reads the node each cycle through :class:`NodeWatch` and drains its
host while the node is cordoned (see ``discovery/agent.py``).

Contract:

- :func:`node_drain_reason` is pure: given the node object (the API's JSON), it returns why the node is
  being emptied (``spec.unschedulable``, or a taint that a cordon or a cluster autoscaler scale-down
  sets), or ``None`` when it is schedulable.
- :meth:`NodeWatch.drain_reason` GETs ``/api/v1/nodes/<name>`` with the pod's service-account token over
  TLS verified against the service-account CA; it raises :class:`NodeWatchError` (one line) on any failure,
  and the caller keeps the last answer it had. The pod needs RBAC ``get`` on ``nodes``
  (``deploy/k8s/rbac.yaml``).
- :func:`in_cluster` builds a watch from the in-cluster environment (``KUBERNETES_SERVICE_HOST``,
  ``KUBERNETES_SERVICE_PORT`` and the mounted service account), or raises ``ValueError`` with one line
  naming what is missing.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from discovery.record import check_name
from elastictrain.errors import ElastictrainError

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

DRAIN_TAINTS = {
    "node.kubernetes.io/unschedulable": "tainted node.kubernetes.io/unschedulable (cordoned)",
    "ToBeDeletedByClusterAutoscaler": "tainted ToBeDeletedByClusterAutoscaler (scale-down)",
}
"""Taint keys that mean the node is being emptied, and how the agent names them in its log."""


class NodeWatchError(ElastictrainError):
    """The node could not be read (API server unreachable, refused, or an unexpected answer)."""


def node_drain_reason(node: Mapping[str, Any]) -> str | None:
    """Why ``node`` (a Node object as the API returns it) is being emptied, or ``None`` if it is not."""
    spec = node.get("spec")
    if not isinstance(spec, Mapping):
        raise NodeWatchError("the node object has no spec")
    if spec.get("unschedulable") is True:
        return "node is cordoned (spec.unschedulable)"
    taints = spec.get("taints") or []
    if not isinstance(taints, list):
        raise NodeWatchError("the node's spec.taints is not a list")
    for taint in taints:
        if isinstance(taint, Mapping) and taint.get("key") in DRAIN_TAINTS:
            return "node is " + DRAIN_TAINTS[taint["key"]]
    return None


class NodeReader(Protocol):
    """What the agent needs of a node watch (tests pass a fake)."""

    def drain_reason(self) -> str | None:
        """Why the node is being emptied, None if it is not; :class:`NodeWatchError` when it cannot be read."""
        ...


Fetch = Callable[[urllib.request.Request, float], bytes]
"""Sends a request with a timeout and returns the body (tests pass a fake)."""


@dataclass
class NodeWatch:
    """Reads one node from the API server. Build it with :func:`in_cluster`."""

    node: str
    api_url: str
    """``https://HOST:PORT`` of the API server."""
    token_file: str
    fetch: Fetch
    timeout_seconds: float = 2.0

    def drain_reason(self) -> str | None:
        """:func:`node_drain_reason` of the node as the API server has it now; :class:`NodeWatchError` if unread."""
        try:
            with open(self.token_file, encoding="utf-8") as f:  # re-read: kubelet rotates projected tokens
                token = f.read().strip()
        except OSError as e:
            raise NodeWatchError(f"cannot read the service account token {self.token_file}: {e.strerror}") from None
        req = urllib.request.Request(
            f"{self.api_url}/api/v1/nodes/{self.node}",
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
        )
        try:
            body = self.fetch(req, self.timeout_seconds)
        except urllib.error.HTTPError as e:
            hint = " (the pod's service account needs 'get' on nodes: deploy/k8s/rbac.yaml)" if e.code == 403 else ""
            raise NodeWatchError(f"GET node {self.node}: HTTP {e.code}{hint}") from None
        except (OSError, ValueError) as e:  # URLError, timeouts and TLS errors are OSErrors
            raise NodeWatchError(f"GET node {self.node}: {e}") from None
        try:
            node = json.loads(body)
        except ValueError:
            raise NodeWatchError(f"GET node {self.node}: the answer is not JSON") from None
        if not isinstance(node, dict):
            raise NodeWatchError(f"GET node {self.node}: the answer is not an object")
        return node_drain_reason(node)


def _tls_fetch(cafile: str) -> Fetch:
    context = ssl.create_default_context(cafile=cafile)

    def fetch(req: urllib.request.Request, timeout: float) -> bytes:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            return bytes(resp.read())

    return fetch


def in_cluster(
    node: str,
    env: Mapping[str, str] = os.environ,
    sa_dir: str = SERVICE_ACCOUNT_DIR,
    timeout_seconds: float = 2.0,
) -> NodeWatch:
    """A :class:`NodeWatch` for ``node`` from the pod's environment; ``ValueError`` naming what is missing."""
    check_name("--drain-when-cordoned node", node)
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise ValueError(
            "--drain-when-cordoned needs the Kubernetes API: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT "
            "are not set (run the agent in a pod)"
        )
    token, ca = os.path.join(sa_dir, "token"), os.path.join(sa_dir, "ca.crt")
    for path in (token, ca):
        if not os.access(path, os.R_OK):
            raise ValueError(
                f"--drain-when-cordoned needs the pod's service account: {path} is not readable "
                "(automountServiceAccountToken: true)"
            )
    try:
        fetch = _tls_fetch(ca)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        raise ValueError(f"--drain-when-cordoned: cannot load the service account CA {ca}: {e}") from None
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return NodeWatch(
        node=node, api_url=f"https://{netloc}", token_file=token, fetch=fetch, timeout_seconds=timeout_seconds
    )
