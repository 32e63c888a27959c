#!/usr/bin/env bash
# make setup: idempotent environment for elastictrain on a Debian machine.
#
#   .venv (python3 >= 3.10) -> torch/torchvision (constraints/torch.txt) -> Horovod 0.28.1 built from
#   its sdist with the C++ standard raised to what torch needs (wheel cached outside the checkout)
#   -> etcd + etcdctl and openssh-server (Debian packages) -> the project, editable, with test/dev extras.
#
# Environment knobs:
#   PYTHON                 interpreter for the venv (default: python3)
#   VENV                   venv folder (default: .venv)
#   ELASTICTRAIN_CACHE     wheel cache (default: ${XDG_CACHE_HOME:-~/.cache}/elastictrain)
#   CUDA_HOME              CUDA toolkit root (default: first real toolkit under /usr/local/cuda*)
#   NCCL_HOME              NCCL root with include/nccl.h and lib/libnccl.so* (default: the NCCL torch loads, i.e.
#                          torch's pip nvidia-nccl package; then the system's)
#   ELASTICTRAIN_EXTRAS    extras installed with the project (default: test,dev; empty for a runtime image)
#   ELASTICTRAIN_GPU_OPS   auto (default) | NCCL | none. auto = NCCL when a CUDA toolkit, NCCL and a GPU are present.
#   ELASTICTRAIN_TORCH     pinned (default) | keep. keep = build against the torch already in the venv (a GPU image's
#                          own build, e.g. an NGC container's) instead of installing constraints/torch.txt's pair.
set -euo pipefail

HOROVOD_VERSION=0.28.1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
CACHE=${ELASTICTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/elastictrain}
GPU_OPS=${ELASTICTRAIN_GPU_OPS:-auto}
TORCH_MODE=${ELASTICTRAIN_TORCH:-pinned}
EXTRAS=${ELASTICTRAIN_EXTRAS-test,dev}

say() { printf '[setup] %s\n' "$*"; }
# shellcheck source=scripts/horovod-nccl.sh
source "$ROOT/scripts/horovod-nccl.sh"
die() { printf 'elastictrain setup: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- prerequisites
command -v "$PYTHON" >/dev/null || die "missing $PYTHON (Python 3.10 or newer): apt-get install python3 python3-venv python3-dev"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "$PYTHON is $("$PYTHON" -c 'import platform; print(platform.python_version())'); Python 3.10 or newer is needed (set PYTHON=python3.x)"
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || die "missing the venv module of $PYTHON: apt-get install python3-venv"
PY_INC=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -f "$PY_INC/Python.h" ] || die "missing Python headers ($PY_INC/Python.h): apt-get install python3-dev"
command -v g++ >/dev/null || command -v c++ >/dev/null || die "missing a C++ compiler: apt-get install g++"
command -v make >/dev/null || die "missing make: apt-get install make"
command -v cmake >/dev/null || die "missing cmake (3.13 or newer): apt-get install cmake"

apt_install() {
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null && sudo -n true 2>/dev/null \
      || die "missing $* and no root for apt: run 'sudo apt-get install -y $*' and then make setup again"
    SUDO=sudo
  else
    SUDO=
  fi
  say "installing Debian packages: $*"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1; $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null; } \
    || die "apt-get install $* failed"
}

# ---------------------------------------------------------------- etcd
missing_deb=()
command -v etcd >/dev/null || missing_deb+=(etcd-server)
command -v etcdctl >/dev/null || missing_deb+=(etcd-client)
if [ ${#missing_deb[@]} -gt 0 ]; then
  apt_install "${missing_deb[@]}"
  # Debian's package may start a system etcd on 2379; tests use their own servers on free ports.
fi
say "etcd: $(etcd --version 2>/dev/null | head -1)"

# ---------------------------------------------------------------- sshd (the multi-node chaos tier)
# chaos/netns.py starts one sshd per network namespace, on that namespace's own link-local address. If Debian's
# postinst starts a system sshd, the tier neither uses it nor collides with it. The tier needs root anyway, so
# without root (or sudo) setup goes on and the tier skips with a message.
if [ ! -x /usr/sbin/sshd ] || ! command -v ssh >/dev/null || ! command -v ssh-keygen >/dev/null; then
  if [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null && sudo -n true 2>/dev/null; }; then
    apt_install openssh-server openssh-client
  else
    say "openssh-server is not installed and there is no root for apt: the multi-node chaos tier will skip"
  fi
fi

# ---------------------------------------------------------------- venv
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip setuptools wheel
fi
case "$VENV" in /*) PY="$VENV/bin/python" ;; *) PY="$ROOT/$VENV/bin/python" ;; esac
PIP=("$PY" -m pip --disable-pip-version-check)
pkg_version() { "$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"; }

# ---------------------------------------------------------------- torch
case "$TORCH_MODE" in
  pinned)
    want_torch=$(sed -n 's/^torch==//p' constraints/torch.txt)
    want_tv=$(sed -n 's/^torchvision==//p' constraints/torch.txt)
    if [ "$(pkg_version torch)" != "$want_torch" ] || [ "$(pkg_version torchvision)" != "$want_tv" ]; then
      say "installing torch==$want_torch torchvision==$want_tv"
      "${PIP[@]}" install -q -c constraints/torch.txt torch torchvision
    fi ;;
  keep)
    "$PY" -c 'import torch' 2>/dev/null || die "ELASTICTRAIN_TORCH=keep but $VENV has no importable torch"
    say "keeping the installed torch $(pkg_version torch)" ;;
  *) die "ELASTICTRAIN_TORCH=$TORCH_MODE is not one of pinned, keep" ;;
esac
TORCH_VER=$(pkg_version torch)
PY_TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# ---------------------------------------------------------------- CUDA / NCCL detection
find_cuda_home() {
  if [ -n "${CUDA_HOME:-}" ]; then echo "$CUDA_HOME"; return; fi
  local d
  for d in /usr/local/cuda /usr/local/cuda-*; do
    # /usr/local/bin/nvcc may be a wrapper script; a real toolkit has the headers next to nvcc.
    if [ -x "$d/bin/nvcc" ] && [ -f "$d/include/cuda_runtime.h" ]; then readlink -f "$d"; return; fi
  done
}
CUDA_DIR=$(find_cuda_home || true)
CUDA_VER=none
if [ -n "$CUDA_DIR" ]; then
  CUDA_VER=$("$CUDA_DIR/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\),.*/\1/p' | head -1)
  CUDA_VER=${CUDA_VER:-unknown}
fi
find_nccl_home() {
  if [ -n "${NCCL_HOME:-}" ]; then echo "$NCCL_HOME"; return; fi
  local d
  # torch's pip NCCL first: Horovod's NCCL ops must use the libnccl.so.2 torch already loaded (torch's RPATH
  # names site-packages/nvidia/nccl/lib), not another version from the system or the CUDA image.
  for d in "$SITE/nvidia/nccl" /usr /usr/local/nccl "$CUDA_DIR"; do
    [ -n "$d" ] && [ -f "$d/include/nccl.h" ] && { echo "$d"; return; }
  done
}
NCCL_DIR=$(find_nccl_home || true)
case "$GPU_OPS" in
  auto)
    if [ -n "$CUDA_DIR" ] && [ -n "$NCCL_DIR" ] && command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU; then
      GPU_OPS=NCCL
    else
      GPU_OPS=none
    fi ;;
  NCCL|nccl)
    GPU_OPS=NCCL
    [ -n "$CUDA_DIR" ] || die "ELASTICTRAIN_GPU_OPS=NCCL but no CUDA toolkit found: set CUDA_HOME to its root"
    [ -n "$NCCL_DIR" ] || die "ELASTICTRAIN_GPU_OPS=NCCL but no NCCL found: set NCCL_HOME to a folder with include/nccl.h" ;;
  none) ;;
  *) die "ELASTICTRAIN_GPU_OPS=$GPU_OPS is not one of auto, NCCL, none" ;;
esac

# ---------------------------------------------------------------- Horovod
# NCCL-shared: wheels built before Horovod was told to link NCCL dynamically have another key.
# patch-<digest>: the hash of elastictrain/horovod/patch.py's edits, so a changed patch is built again and never taken from
# the cache. The patch also writes horovod/elastictrain_patch.py naming that digest: the installed package must carry
# it (elastictrain launch and every worker refuse a Horovod without it, such as a stock wheel installed over ours).
PATCH_DIGEST=$("$PY" "$ROOT/elastictrain/horovod/patch.py" --digest) || die "elastictrain/horovod/patch.py --digest failed"
KEY="horovod-${HOROVOD_VERSION}_torch-${TORCH_VER}_${PY_TAG}_cuda-${CUDA_VER}_gpuops-${GPU_OPS/NCCL/NCCL-shared}_patch-${PATCH_DIGEST}"
WHEEL_DIR="$CACHE/wheels/$KEY"
STAMP="$VENV/.horovod-key"
MARKER_LINE="PATCH_DIGEST = \"$PATCH_DIGEST\""
patched_horovod() { grep -qxF "$MARKER_LINE" "$SITE/horovod/elastictrain_patch.py" 2>/dev/null; }
if [ "$(cat "$STAMP" 2>/dev/null)" = "$KEY" ] && [ "$(pkg_version horovod)" = "$HOROVOD_VERSION" ] && patched_horovod; then
  say "horovod $HOROVOD_VERSION already installed ($KEY)"
else
  if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    say "building horovod $HOROVOD_VERSION from sdist ($KEY); this takes a few minutes"
    "${PIP[@]}" install -q 'cffi>=1.4.0' cloudpickle psutil pyyaml packaging
    BUILD=$(mktemp -d "${TMPDIR:-/tmp}/elastictrain-hvd-build.XXXXXX")
    trap 'rm -rf "$BUILD"' EXIT
    "${PIP[@]}" download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD" \
      || die "could not download the horovod==$HOROVOD_VERSION sdist from the package index"
    tar -xzf "$BUILD"/horovod-"$HOROVOD_VERSION".tar.gz -C "$BUILD"
    SRC="$BUILD/horovod-$HOROVOD_VERSION"
    # The C++ standard the installed torch requires (TorchConfig.cmake declares it; 17 if it does not say).
    STD=$(sed -n 's/.*CXX_STANDARD \([0-9][0-9]*\).*/\1/p' "$SITE/torch/share/cmake/Torch/TorchConfig.cmake" 2>/dev/null | sort -n | tail -1)
    STD=${STD:-17}
    say "raising Horovod's C++ standard 14 -> $STD (torch $TORCH_VER)"
    sed -i "s/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD $STD)/" "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q "CMAKE_CXX_STANDARD $STD" "$SRC/horovod/torch/CMakeLists.txt" || die "patching Horovod's CMakeLists failed (layout changed?)"
    "$PY" "$ROOT/elastictrain/horovod/patch.py" "$SRC" || die "patching Horovod's source failed (elastictrain/horovod/patch.py)"
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
    export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    export MAKEFLAGS="-j$(nproc)"
    if [ -n "$CUDA_DIR" ]; then
      # torch's CMake config looks for a CUDA toolkit even for CPU operations.
      export CUDA_HOME="$CUDA_DIR" CUDAToolkit_ROOT="$CUDA_DIR" HOROVOD_CUDA_HOME="$CUDA_DIR"
    fi
    if [ "$GPU_OPS" = NCCL ]; then
      # Shared, from NCCL_DIR only (scripts/horovod-nccl.sh says why).
      horovod_nccl_env "$NCCL_DIR" 2>/dev/null || die "NCCL for Horovod: $(horovod_nccl_env "$NCCL_DIR" 2>&1 >/dev/null)"
    fi
    LOG="$CACHE/build-$KEY.log"
    mkdir -p "$CACHE"
    ( cd "$SRC" && "${PIP[@]}" wheel -v --no-build-isolation --no-deps -w "$BUILD/dist" . ) >"$LOG" 2>&1 \
      || { tail -30 "$LOG" >&2; die "horovod build failed; full log: $LOG"; }
    mkdir -p "$WHEEL_DIR"
    cp "$BUILD"/dist/horovod-*.whl "$WHEEL_DIR/.tmp.whl"
    mv "$WHEEL_DIR/.tmp.whl" "$WHEEL_DIR/$(basename "$BUILD"/dist/horovod-*.whl)"
    say "cached $(ls "$WHEEL_DIR"/horovod-*.whl)"
  else
    say "reusing cached wheel $(ls "$WHEEL_DIR"/horovod-*.whl)"
  fi
  "${PIP[@]}" install -q --force-reinstall --no-deps "$WHEEL_DIR"/horovod-*.whl
  patched_horovod || die "the horovod wheel in $WHEEL_DIR lacks the patch marker ($MARKER_LINE); remove $WHEEL_DIR and run setup again"
  "${PIP[@]}" install -q 'cffi>=1.4.0' cloudpickle psutil pyyaml packaging
  if [ "$GPU_OPS" = NCCL ]; then
    for so in "$SITE"/horovod/torch/mpi_lib_v2*.so; do
      horovod_nccl_check "$so" || die "Horovod's NCCL operations do not share torch's NCCL; remove $WHEEL_DIR and run setup again"
    done
  fi
  echo "$KEY" >"$STAMP"
fi

# ---------------------------------------------------------------- the project
PROJECT_STAMP="$(sha256sum pyproject.toml | cut -c1-16) extras=$EXTRAS"
if [ "$(cat "$VENV/.project-stamp" 2>/dev/null)" != "$PROJECT_STAMP" ] || [ -z "$(pkg_version elastictrain)" ]; then
  say "installing elastictrain (editable) with extras [${EXTRAS}]"
  "${PIP[@]}" install -q -c constraints/torch.txt -e ".${EXTRAS:+[$EXTRAS]}"
  echo "$PROJECT_STAMP" >"$VENV/.project-stamp"
fi

"$VENV/bin/horovodrun" --check-build
