"""scripts/horovod-nccl.sh: Horovod's NCCL build is told to link the NCCL torch loads, dynamically, and the check
after the build refuses a library that links NCCL statically or carries its own copy.

Real shared objects made with the C compiler stand in for libnccl.so.2 and Horovod's extension.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.procs import REPO

pytestmark = pytest.mark.integration

HELPER = REPO / "scripts" / "horovod-nccl.sh"
CC = shutil.which("cc") or shutil.which("gcc")


def bash(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", f'source "{HELPER}"; {script}'], cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip


def compile_so(out: Path, source: str, *link: str, soname: str | None = None) -> Path:
    if CC is None:
        pytest.skip("no C compiler")
    src = out.with_suffix(".c")
    src.write_text(source)
    args = [CC, "-shared", "-fPIC", "-o", str(out), str(src), *link]
    if soname:
        args.insert(1, f"-Wl,-soname,{soname}")
    subprocess.run(args, check=True, capture_output=True, timeout=60)
    return out


def pip_nccl(tmp_path: Path) -> Path:
    """A folder laid out like pip's nvidia-nccl: include/nccl.h and lib/libnccl.so.2 only."""
    nccl = tmp_path / "nvidia" / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "lib").mkdir()
    (nccl / "include" / "nccl.h").write_text("int ncclAllReduce(void);\n")
    compile_so(nccl / "lib" / "libnccl.so.2", "int ncclAllReduce(void) { return 0; }\n", soname="libnccl.so.2")
    return nccl


def test_the_build_is_told_to_link_shared_from_torchs_nccl_only(tmp_path: Path) -> None:
    nccl = pip_nccl(tmp_path)
    out = bash(f'horovod_nccl_env "{nccl}" && env | grep ^HOROVOD_ | sort', tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "HOROVOD_GPU_OPERATIONS=NCCL",
        f"HOROVOD_NCCL_HOME={nccl}",
        f"HOROVOD_NCCL_INCLUDE={nccl}/include",
        f"HOROVOD_NCCL_LIB={nccl}/lib",
        "HOROVOD_NCCL_LINK=SHARED",  # Horovod 0.28.1 links libnccl_static.a from anywhere unless told so
    ]
    assert (nccl / "lib" / "libnccl.so").resolve() == (nccl / "lib" / "libnccl.so.2").resolve()


def test_a_folder_without_nccl_is_one_line(tmp_path: Path) -> None:
    out = bash(f'horovod_nccl_env "{tmp_path}"', tmp_path)
    assert out.returncode == 1 and out.stderr == f"no NCCL header {tmp_path}/include/nccl.h\n"


def test_the_check_accepts_a_dynamic_link_and_refuses_a_static_or_second_nccl(tmp_path: Path) -> None:
    nccl = pip_nccl(tmp_path)
    bash(f'horovod_nccl_env "{nccl}"', tmp_path)
    uses = "int ncclAllReduce(void);\nint hvd_allreduce(void) { return ncclAllReduce(); }\n"
    dynamic = compile_so(tmp_path / "dynamic.so", uses, f"-L{nccl}/lib", "-lnccl")
    assert bash(f'horovod_nccl_check "{dynamic}"', tmp_path).returncode == 0

    own = "int ncclAllReduce(void) { return 1; }\nint hvd_allreduce(void) { return ncclAllReduce(); }\n"
    static = compile_so(tmp_path / "static.so", own)
    out = bash(f'horovod_nccl_check "{static}"', tmp_path)
    assert out.returncode == 1 and "does not load libnccl.so.2 dynamically" in out.stderr

    both = compile_so(tmp_path / "both.so", own, f"-L{nccl}/lib", "-Wl,--no-as-needed", "-lnccl")
    out = bash(f'horovod_nccl_check "{both}"', tmp_path)
    assert out.returncode == 1 and "defines ncclAllReduce itself" in out.stderr
