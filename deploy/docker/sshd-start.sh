#!/bin/sh
# Start a worker node's sshd in the foreground (the worker-sshd container's command).
#
# Host keys are generated here, at container start, in a writable folder (an emptyDir under a read-only
# root filesystem), so no two containers of the image share a host key and none is baked into a layer.
# A container restart keeps the key while its folder survives (the pod's emptyDir), so known_hosts stays valid.
#
#   SSHD_HOST_KEY_DIR     where the host key lives (default /run/elastictrain/sshd)
#   SSHD_CONFIG           sshd config file (default /etc/elastictrain/sshd_config)
#   SSHD_PORT             listen port (default: the config's Port, 2222)
#   SSHD                  sshd binary (default /usr/sbin/sshd)
set -eu
KEY_DIR=${SSHD_HOST_KEY_DIR:-/run/elastictrain/sshd}
CONFIG=${SSHD_CONFIG:-/etc/elastictrain/sshd_config}
SSHD=${SSHD:-/usr/sbin/sshd}
KEY="$KEY_DIR/ssh_host_ed25519_key"

mkdir -p "$KEY_DIR"
chmod 700 "$KEY_DIR"
if [ ! -s "$KEY" ]; then
  rm -f "$KEY" "$KEY.pub"
  ssh-keygen -q -t ed25519 -N '' -C "elastictrain-worker-sshd" -f "$KEY"
  echo "sshd-start: generated host key $(ssh-keygen -l -f "$KEY.pub")" >&2
fi
set -- -D -e -f "$CONFIG" -h "$KEY"
if [ -n "${SSHD_PORT:-}" ]; then
  set -- "$@" -p "$SSHD_PORT"
fi
"$SSHD" -t "$@"
exec "$SSHD" "$@"
