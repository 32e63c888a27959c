#!/bin/sh
# Prepare one etcd member before it starts (the init container of deploy/k8s/etcd.yaml; in the image as
# elastictrain-etcd-member): write etcd's config file, and rejoin a member that lost its volume.
#
# A member whose data dir is empty while the cluster still lists it cannot simply start again: with
# initial-cluster-state "new" it would try to bootstrap a cluster of its own, and with "existing" it is refused as
# already bootstrapped. So this script removes the member and adds it again under the same name and peer URL, and
# the member then starts empty and receives the data from the others. What it decides, from the data dir and what
# the other members answer (`etcdctl member list`):
#
#   data dir has member/                         -> nothing to do: etcd restarts from its data
#   no other member answers                      -> "new": the cluster's first start
#   the cluster lists this name, started         -> volume lost: member remove OLD_ID, member add -> "existing"
#   the cluster lists this peer URL, unstarted   -> "existing": added by an earlier run that was cut short
#   the cluster does not list it                 -> member add -> "existing"
#
# etcdctl calls a member started once it has a name, and the first start names every member of the initial cluster:
# a member that comes up after the others formed the cluster is also removed and added (it has no data to lose).
# Each step can be interrupted and run again (the init container restarts): a member removed but not added yet is
# "not listed", one added but not started is "unstarted". Removing and adding need a quorum of the others; without
# one, etcdctl keeps failing, this script exits 1 after ETCD_MEMBER_RETRY_SECONDS and the init container restarts
# (a cluster that lost its quorum needs a snapshot restore instead: etcd's disaster recovery). A remove that timed out
# may still commit once the quorum is back; the next run then finds the member not listed and adds it.
#
# TLS is required, for clients and peers alike (client-cert-auth on both). The member uses its server certificate
# (which needs the clientAuth usage too) as etcdctl's client certificate.
#
# Environment (all required unless a default is shown):
#   ETCD_MEMBER_NAME            this member's name (the pod's name: etcd-0)
#   ETCD_MEMBER_CLUSTER         every member as NAME=PEER_URL,... (the initial cluster)
#   ETCD_MEMBER_CLIENT_URL      this member's advertised client URL
#   ETCD_MEMBER_ENDPOINTS       client URLs of all members, comma-separated (its own is skipped)
#   ETCD_MEMBER_DATA_DIR        its data dir (the volume)
#   ETCD_MEMBER_CONFIG          the etcd config file to write (etcd --config-file)
#   ETCD_MEMBER_CA              CA of the client and peer certificates
#   ETCD_MEMBER_SERVER_CERT, ETCD_MEMBER_SERVER_KEY   client-side certificate and key (serverAuth + clientAuth)
#   ETCD_MEMBER_PEER_CERT, ETCD_MEMBER_PEER_KEY       peer certificate and key (serverAuth + clientAuth)
#   ETCD_MEMBER_LISTEN_CLIENT   default https://0.0.0.0:2379
#   ETCD_MEMBER_LISTEN_PEER     default https://0.0.0.0:2380
#   ETCD_MEMBER_LISTEN_METRICS  default http://0.0.0.0:2381 (/health for the probes; no data is served there)
#   ETCD_MEMBER_TOKEN           initial cluster token, default elastictrain-etcd
#   ETCD_MEMBER_RETRY_SECONDS   how long to retry a refused member remove or add, default 60
#   ETCDCTL                     etcdctl binary, default etcdctl
#
# Exit codes: 0 config written; 1 the cluster could not be changed (retry); 2 a missing or bad setting.
set -eu

say() { printf 'etcd-member: %s\n' "$*" >&2; }
die() { printf 'etcd-member: error: %s\n' "$2" >&2; exit "$1"; }

for var in ETCD_MEMBER_NAME ETCD_MEMBER_CLUSTER ETCD_MEMBER_CLIENT_URL ETCD_MEMBER_ENDPOINTS ETCD_MEMBER_DATA_DIR \
    ETCD_MEMBER_CONFIG ETCD_MEMBER_CA ETCD_MEMBER_SERVER_CERT ETCD_MEMBER_SERVER_KEY ETCD_MEMBER_PEER_CERT \
    ETCD_MEMBER_PEER_KEY; do
  eval "value=\${$var:-}"
  [ -n "$value" ] || die 2 "$var is not set"
done
for file in "$ETCD_MEMBER_CA" "$ETCD_MEMBER_SERVER_CERT" "$ETCD_MEMBER_SERVER_KEY" "$ETCD_MEMBER_PEER_CERT" \
    "$ETCD_MEMBER_PEER_KEY"; do
  [ -r "$file" ] || die 2 "cannot read $file"
done
NAME=$ETCD_MEMBER_NAME
ETCDCTL=${ETCDCTL:-etcdctl}
PEER_URL=$(printf '%s\n' "$ETCD_MEMBER_CLUSTER" | tr ',' '\n' | sed -n "s|^$NAME=||p" | head -1)
[ -n "$PEER_URL" ] || die 2 "ETCD_MEMBER_CLUSTER has no entry for $NAME"
OTHERS=$(printf '%s\n' "$ETCD_MEMBER_ENDPOINTS" | tr ',' '\n' | grep -vxF "$ETCD_MEMBER_CLIENT_URL" | paste -sd, -)

ctl() {
  ETCDCTL_API=3 "$ETCDCTL" --endpoints="$OTHERS" --cacert="$ETCD_MEMBER_CA" --cert="$ETCD_MEMBER_SERVER_CERT" \
    --key="$ETCD_MEMBER_SERVER_KEY" --dial-timeout=2s --command-timeout=10s "$@"
}

# retry WHAT CMD...: run CMD until it succeeds or ETCD_MEMBER_RETRY_SECONDS (60) pass. etcd refuses a change
# ("unhealthy cluster") until every remaining member has been connected for 5 s, which is not yet the case right
# after a remove or a restart, and a member that has just started may have no leader yet.
retry() {
  what=$1
  shift
  deadline=$(( $(date +%s) + ${ETCD_MEMBER_RETRY_SECONDS:-60} ))
  until ERR=$("$@" 2>&1 >/dev/null); do
    [ "$(date +%s)" -lt "$deadline" ] || die 1 "$what failed: $(printf '%s\n' "$ERR" | tail -1); retrying later"
    sleep 2
  done
}

# `member list -w simple`: ID, STATUS, NAME, PEER_URLS, CLIENT_URLS, IS_LEARNER (comma and space separated).
members() { ctl member list -w simple 2>/dev/null | sed 's/, /,/g'; }

# initial-cluster for "existing": every listed member by name, this one (perhaps unstarted, so unnamed) by its URL.
cluster_of() {
  printf '%s\n' "$1" | awk -F, -v name="$NAME" -v url="$PEER_URL" '
    $4 == url { printf "%s%s=%s", sep, name, url; sep = ","; next }
    $3 != "" { printf "%s%s=%s", sep, $3, $4; sep = "," }'
}

if [ -d "$ETCD_MEMBER_DATA_DIR/member" ]; then
  say "$NAME: data dir $ETCD_MEMBER_DATA_DIR holds a member; etcd restarts from it"
  STATE=existing CLUSTER=$ETCD_MEMBER_CLUSTER
elif [ -z "$OTHERS" ] || ! LIST=$(members) || [ -z "$LIST" ]; then
  say "$NAME: empty data dir and no other member answers; starting a new cluster"
  STATE=new CLUSTER=$ETCD_MEMBER_CLUSTER
else
  OLD=$(printf '%s\n' "$LIST" | awk -F, -v name="$NAME" '$3 == name && $2 == "started" { print $1 }')
  UNSTARTED=$(printf '%s\n' "$LIST" | awk -F, -v url="$PEER_URL" '$4 == url && $2 == "unstarted" { print $1 }')
  if [ -n "$OLD" ]; then
    say "$NAME: empty data dir but the cluster lists it as member $OLD: its volume was lost; removing and adding it"
    retry "member remove $OLD" ctl member remove "$OLD"
    UNSTARTED=
  fi
  if [ -z "$UNSTARTED" ]; then
    retry "member add $NAME" ctl member add "$NAME" --peer-urls="$PEER_URL"
    say "$NAME: added to the cluster with peer URL $PEER_URL"
  else
    say "$NAME: the cluster lists it as unstarted; joining"
  fi
  LIST=$(members) || die 1 "member list failed after the change; retrying later"
  STATE=existing CLUSTER=$(cluster_of "$LIST")
fi

mkdir -p "$(dirname "$ETCD_MEMBER_CONFIG")"
TMP=$(mktemp "$ETCD_MEMBER_CONFIG.XXXXXX")
trap 'rm -f "$TMP"' EXIT
cat >"$TMP" <<EOF
# Written by etcd-member.sh for $NAME (initial-cluster-state $STATE).
name: $NAME
data-dir: $ETCD_MEMBER_DATA_DIR
listen-client-urls: ${ETCD_MEMBER_LISTEN_CLIENT:-https://0.0.0.0:2379}
advertise-client-urls: $ETCD_MEMBER_CLIENT_URL
listen-peer-urls: ${ETCD_MEMBER_LISTEN_PEER:-https://0.0.0.0:2380}
initial-advertise-peer-urls: $PEER_URL
listen-metrics-urls: ${ETCD_MEMBER_LISTEN_METRICS:-http://0.0.0.0:2381}
initial-cluster: $CLUSTER
initial-cluster-token: ${ETCD_MEMBER_TOKEN:-elastictrain-etcd}
initial-cluster-state: $STATE
auto-compaction-mode: revision
auto-compaction-retention: "10000"
client-transport-security:
  cert-file: $ETCD_MEMBER_SERVER_CERT
  key-file: $ETCD_MEMBER_SERVER_KEY
  trusted-ca-file: $ETCD_MEMBER_CA
  client-cert-auth: true
peer-transport-security:
  cert-file: $ETCD_MEMBER_PEER_CERT
  key-file: $ETCD_MEMBER_PEER_KEY
  trusted-ca-file: $ETCD_MEMBER_CA
  client-cert-auth: true
EOF
chmod 644 "$TMP"
mv "$TMP" "$ETCD_MEMBER_CONFIG"
trap - EXIT
say "$NAME: wrote $ETCD_MEMBER_CONFIG (initial-cluster-state $STATE)"
