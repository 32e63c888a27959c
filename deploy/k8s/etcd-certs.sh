#!/bin/sh
# Make the certificates of the example etcd (deploy/k8s/etcd.yaml) and its clients with openssl: a CA, a server
# certificate (client port), a peer certificate (member to member) and one client certificate for the agents, the
# launcher and the workers. EC P-256 keys, valid for ETCD_CERT_DAYS (365) days. For production, prefer your PKI
# (cert-manager, Vault); what each certificate needs is below.
#
#   deploy/k8s/etcd-certs.sh OUT_DIR [NAMESPACE]      (NAMESPACE default elastictrain)
#
# Writes OUT_DIR/{ca,server,peer,client}.{crt,key}; refuses an OUT_DIR that already holds a ca.key.
# - server and peer: serverAuth + clientAuth (a member uses its server certificate as etcdctl's client
#   certificate, and etcd's JSON gateway, which discover.sh uses, connects with it too); SANs: every member's
#   name under the headless Service (etcd-N.etcd.NAMESPACE.svc[.cluster.local]) and the wildcard for them.
# - client: clientAuth, names in the SAN only, no CommonName (with etcd auth on, etcd refuses gateway requests
#   made with a certificate that has one).
# ETCD_CERT_EXTRA_SANS adds SANs to server and peer (e.g. IP:127.0.0.1,DNS:localhost for a test on one machine).
# Exit codes: 0 written; 1 openssl failed; 2 bad usage.
set -eu
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: etcd-certs.sh OUT_DIR [NAMESPACE]" >&2; exit 2; }
OUT=$1
NS=${2:-elastictrain}
DAYS=${ETCD_CERT_DAYS:-365}
case $NS in *[!a-z0-9-]*|'') echo "etcd-certs: error: invalid namespace '$NS'" >&2; exit 2 ;; esac
[ ! -e "$OUT/ca.key" ] || { echo "etcd-certs: error: $OUT/ca.key exists; not overwriting a CA" >&2; exit 2; }
mkdir -p "$OUT"
umask 077
TMP=$(mktemp -d "$OUT/.etcd-certs.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

SANS="DNS:*.etcd.$NS.svc,DNS:*.etcd.$NS.svc.cluster.local,DNS:etcd.$NS.svc"
for i in 0 1 2; do SANS="$SANS,DNS:etcd-$i.etcd.$NS.svc,DNS:etcd-$i.etcd.$NS.svc.cluster.local"; done
[ -z "${ETCD_CERT_EXTRA_SANS:-}" ] || SANS="$SANS,$ETCD_CERT_EXTRA_SANS"

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key "$TMP/ca.key"
openssl req -x509 -new -key "$TMP/ca.key" -days "$DAYS" -subj "/CN=elastictrain etcd CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" -out "$TMP/ca.crt"

# sign NAME SUBJECT EXTENSIONS: NAME.key and NAME.crt signed by the CA.
sign() {
  key "$TMP/$1.key"
  printf '%s\n' "$3" >"$TMP/$1.ext"
  openssl req -new -key "$TMP/$1.key" -subj "$2" -out "$TMP/$1.csr"
  openssl x509 -req -in "$TMP/$1.csr" -CA "$TMP/ca.crt" -CAkey "$TMP/ca.key" -CAcreateserial -days "$DAYS" \
    -extfile "$TMP/$1.ext" -out "$TMP/$1.crt" 2>/dev/null
}
BOTH="basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$SANS"
sign server "/CN=etcd" "$BOTH"
sign peer "/CN=etcd-peer" "$BOTH"
sign client "/" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth
subjectAltName=critical,DNS:elastictrain-client"

for f in ca server peer client; do
  mv "$TMP/$f.crt" "$OUT/$f.crt"
  mv "$TMP/$f.key" "$OUT/$f.key"
done
chmod 644 "$OUT"/*.crt
echo "etcd-certs: wrote $OUT/{ca,server,peer,client}.{crt,key} for namespace $NS" >&2
