#!/usr/bin/env bash
# Throwaway certificates for TLS under compose (docs/operations.md): a CA, a server
# certificate for the `nats` and `kvstore` services (and localhost), and one client
# certificate every service presents. For a first try only: use your own PKI in production.
# On several machines (compose/docker-compose.multihost.yml), name them after the directory:
# the server certificate covers them, and serves the NATS nodes' routes to each other too.
#   scripts/make_dev_certs.sh [directory, default compose/tls] [host name ...]
set -euo pipefail
out="${1:-$(dirname "$0")/../compose/tls}"
extra_names=""
for host in "${@:2}"; do extra_names+=",DNS:$host"; done
mkdir -p "$out"
cd "$out"
days=365

openssl req -x509 -newkey rsa:2048 -nodes -days "$days" -subj "/CN=llm-mesh dev CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout ca-key.pem -out ca.pem 2>/dev/null

issue() {  # name, subject CN, extensions
    openssl req -newkey rsa:2048 -nodes -subj "/CN=$2" -keyout "$1-key.pem" -out "$1.csr" \
        2>/dev/null
    printf '%s\n' "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial \
        -days "$days" -extfile "$1.ext" -out "$1.pem" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
}
issue server nats "subjectAltName=DNS:nats,DNS:kvstore,DNS:localhost,IP:127.0.0.1$extra_names
extendedKeyUsage=serverAuth,clientAuth"
issue client llm-mesh-service "extendedKeyUsage=clientAuth"
rm -f ca.srl
# The services' image runs as uid 10001, which must read the client key through the bind
# mount: readable by all, as befits throwaway keys (keep real ones 0600, owned by 10001).
chmod 644 client-key.pem server-key.pem
chmod 600 ca-key.pem
echo "certificates in $(pwd): ca.pem, server.pem, server-key.pem, client.pem, client-key.pem"
