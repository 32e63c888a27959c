#!/bin/sh
# Host discovery for `horovodrun --host-discovery-script`: prints sorted `host:slots` lines of the
# ready hosts of $ELASTICTRAIN_JOB in the etcd at $ELASTICTRAIN_ETCD. See discovery/discover.py.
here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd) || exit 2
root=$(dirname -- "$here")
py=${ELASTICTRAIN_PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
# -S skips site-packages (stdlib only, faster start); PYTHONPATH makes `discovery` importable.
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -S -m discovery.discover
