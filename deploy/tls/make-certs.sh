#!/bin/sh
# A private CA and one certificate for the processes of a pagedkv cluster, for TLS on every
# port (deploy/README.md, "TLS"). The certificate is for servers and clients alike (mTLS).
#
#   deploy/tls/make-certs.sh OUT_DIR [NAME ...]
#
# NAMEs are the host names and IP addresses clients dial (default: the compose services and
# localhost). Writes OUT_DIR/ca.crt, tls.crt, tls.key (readable by the containers' uid: a
# development CA; in production issue certificates from your own PKI or cert-manager, and
# keep ca.key off the cluster). Needs openssl.
set -eu
out=${1:?usage: make-certs.sh OUT_DIR [NAME ...]}
shift
names=${*:-"coordinator node-0 node-1 localhost 127.0.0.1"}
mkdir -p "$out"
san=""
for n in $names; do
    case $n in
        *[!0-9.]*) san="$san,DNS:$n" ;;
        *) san="$san,IP:$n" ;;
    esac
done
ext="$out/ext.cnf"
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' "${san#,}" >"$ext"
ec="-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"
# shellcheck disable=SC2086
openssl req -x509 $ec -days 3650 -subj "/CN=pagedkv dev CA" -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null
# shellcheck disable=SC2086
openssl req $ec -subj "/CN=pagedkv" -keyout "$out/tls.key" -out "$out/tls.csr" 2>/dev/null
openssl x509 -req -in "$out/tls.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial -days 825 \
    -extfile "$ext" -out "$out/tls.crt" 2>/dev/null
rm -f "$out/tls.csr" "$ext" "$out/ca.srl"
chmod 600 "$out/ca.key"
chmod 644 "$out/ca.crt" "$out/tls.crt" "$out/tls.key"
echo "wrote $out/ca.crt, $out/tls.crt and $out/tls.key for: $names"
