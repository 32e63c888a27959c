# elastictrain on a CUDA base image: the same scripts/setup.sh as on a workstation (torch pinned in
# constraints/torch.txt, Horovod 0.28.1 built from source with the C++ standard torch needs), here with
# NCCL GPU operations. One image serves the node agent, the workers (started over ssh by horovodrun) and
# the launcher; see docs/multinode.md and deploy/k8s/.
#
#   docker build -t elastictrain:latest .
#   docker build --build-arg CUDA_IMAGE=nvidia/cuda:12.6.3-devel-ubuntu24.04 -t elastictrain:cu126 .
#
# Pick the CUDA image whose major version matches the CUDA build of the torch in constraints/torch.txt.
# docker build has no GPU, so NCCL operations are requested explicitly (ELASTICTRAIN_GPU_OPS=NCCL): the
# build fails with one line when the toolkit or NCCL is missing instead of silently building CPU-only.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# Python and a compiler for the Horovod build; etcd (server for tests and small clusters, etcdctl for
# operators); openssh for horovodrun, which starts workers on other nodes over ssh; NCCL headers and
# library from NVIDIA's apt repository (already configured in the CUDA images).
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev g++ make cmake git ca-certificates \
      etcd-server etcd-client openssh-client openssh-server iproute2 \
      libnccl2 libnccl-dev \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /run/sshd

WORKDIR /opt/elastictrain
# Only what setup and the package need (no .venv, runs/ or caches from a build context).
COPY pyproject.toml README.md Makefile ./
COPY constraints/ constraints/
COPY scripts/ scripts/
COPY elastictrain/ elastictrain/
COPY discovery/ discovery/
COPY chaos/ chaos/
COPY configs/ configs/
COPY docs/ docs/

ENV CUDA_HOME=/usr/local/cuda \
    ELASTICTRAIN_GPU_OPS=NCCL \
    ELASTICTRAIN_CACHE=/tmp/elastictrain-cache
RUN bash scripts/setup.sh \
 && touch .venv/.setup-done \
 && rm -rf /tmp/elastictrain-cache /root/.cache/pip

ENV PATH=/opt/elastictrain/.venv/bin:$PATH \
    ELASTICTRAIN_LOG_FORMAT=json

# 2222: sshd of a worker node (horovodrun -p 2222); 2379/2380: etcd when this image runs it.
EXPOSE 2222 2379 2380
ENTRYPOINT ["elastictrain"]
CMD ["--help"]
