#!/bin/sh
# Host discovery for `horovodrun --host-discovery-script`: prints sorted `host:slots` lines of the
# ready hosts of $ELASTICTRAIN_JOB in the etcd at $ELASTICTRAIN_ETCD. See discovery/discover.py.
here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd) || exit 2
root=$(dirname -- "$here")
py=${ELASTICTRAIN_PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
# Bytecode goes to the user's cache ($PYTHONPYCACHEPREFIX if set), even under PYTHONDONTWRITEBYTECODE (our image
# sets it) or a read-only install: otherwise every call, once a second, compiles discover.py and its imports again.
pycache=${PYTHONPYCACHEPREFIX:-${XDG_CACHE_HOME:-${HOME:-/nonexistent}/.cache}/elastictrain/pycache}
# -S skips site-packages (stdlib only, faster start); PYTHONPATH makes `discovery` importable.
PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$pycache PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -S -m discovery.discover
