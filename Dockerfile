# elastictrain on a CUDA base image. One image serves every role: the node agent, a worker node's sshd (horovodrun
# starts the workers through it), the launcher, and the etcd member helper; see docs/multinode.md and deploy/k8s/.
#
#   docker build -t elastictrain:latest .
#
# Two stages:
# - build: the CUDA devel image, where scripts/setup.sh (the same script as on a workstation) installs the torch
#   pinned in constraints/torch.txt and builds Horovod 0.28.1 from source with NCCL GPU operations. torch 2.14.1 is
#   the cu130 build (CUDA 13.0, NCCL 2.30 from the nvidia-nccl pip package), so the base image is CUDA 13.x, and
#   setup.sh builds Horovod against that same pip NCCL (its headers and the libnccl.so.2 torch loads), not the
#   system's. docker build has no GPU, so NCCL operations are requested explicitly (ELASTICTRAIN_GPU_OPS=NCCL): the
#   build fails with one line when the toolkit or NCCL is missing instead of silently building CPU-only. Only the
#   project's runtime dependencies are installed (ELASTICTRAIN_EXTRAS empty: no test or dev extras).
# - runtime: the CUDA base image (no compiler, no toolkit; torch brings its CUDA libraries as pip packages) with the
#   venv and the sources copied from build. It runs as the non-root user elastictrain (uid 10001). sshd runs as that
#   user too, on port 2222, so only that user can log in; its host key is generated when the container starts
#   (deploy/docker/sshd-start.sh), never baked into a layer: the openssh-server package's keys are deleted here.
#
# Pick CUDA_VERSION with the major version of torch's CUDA build (constraints/torch.txt; `python -c "import torch;
# print(torch.version.cuda)"`). The image was not built here (no Docker registry can be reached); hadolint checks
# this file in `make lint` and tests/unit/test_deploy.py checks the runtime stage's contents.
ARG CUDA_VERSION=13.0.0
ARG UBUNTU_VERSION=24.04

# ------------------------------------------------------------------------------------------------ build
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# Compilers and headers for the Horovod build; etcd and openssh only because setup.sh checks for them (this stage
# is thrown away). Debian package versions are not pinned: the Ubuntu release pins them.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev g++ make cmake git ca-certificates \
      etcd-server etcd-client openssh-client openssh-server \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/elastictrain
# Only what setup and the package need (no .venv, runs/ or caches from a build context).
COPY pyproject.toml README.md Makefile ./
COPY constraints/ constraints/
COPY scripts/ scripts/
COPY elastictrain/ elastictrain/
COPY discovery/ discovery/
COPY chaos/ chaos/
COPY configs/ configs/

ENV CUDA_HOME=/usr/local/cuda \
    ELASTICTRAIN_GPU_OPS=NCCL \
    ELASTICTRAIN_EXTRAS= \
    ELASTICTRAIN_CACHE=/tmp/elastictrain-cache
RUN bash scripts/setup.sh \
 && .venv/bin/horovodrun --check-build | grep -q '\[X\] NCCL' \
 && touch .venv/.setup-done \
 && rm -rf /tmp/elastictrain-cache

# ------------------------------------------------------------------------------------------------ runtime
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive

# python3 for the venv (same Ubuntu release as build, so the venv's interpreter link holds); etcd (a server for
# `elastictrain launch` without --etcd, etcdctl for operators and the etcd member helper); openssh for horovodrun.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 ca-certificates iproute2 etcd-server etcd-client openssh-client openssh-server \
 && rm -rf /var/lib/apt/lists/* \
 && rm -f /etc/ssh/ssh_host_* \
 && useradd --uid 10001 --user-group --create-home --shell /bin/bash elastictrain

COPY --from=build /opt/elastictrain /opt/elastictrain
COPY deploy/docker/sshd_config /etc/elastictrain/sshd_config
COPY deploy/docker/ssh_config /etc/ssh/ssh_config.d/elastictrain.conf
COPY deploy/docker/sshd-start.sh /usr/local/bin/elastictrain-sshd
COPY deploy/k8s/etcd-member.sh /usr/local/bin/elastictrain-etcd-member

ENV PATH=/opt/elastictrain/.venv/bin:$PATH \
    HOME=/home/elastictrain \
    ELASTICTRAIN_LOG_FORMAT=json \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/elastictrain
USER 10001:10001

# 2222: sshd of a worker node (horovodrun -p 2222); 2379/2380: etcd when this image runs it.
EXPOSE 2222 2379 2380
ENTRYPOINT ["elastictrain"]
CMD ["--help"]
