#!/bin/sh
# Container entrypoint for docker-compose.yml.
#
#   talos-entrypoint node NAME PEER...        run a talosd node
#   talos-entrypoint tool NAME ALLOWED...     run talos-proxy serve with mcp-server-time
#
# Each container creates its identity on first start in its own volume
# (/home/talos/node) and publishes its DID to the shared /directory volume;
# peers are wired by address + DID read from there, so every link pins the
# identity it expects.
set -eu
role=$1; name=$2; shift 2
home=/home/talos/node
dir=/directory
port=7400

if [ ! -f "$home/identity.key" ]; then
  if [ "$role" = tool ]; then talos-proxy id --home "$home" >/dev/null; else talosd init --home "$home" >/dev/null; fi
fi
if [ "$role" = tool ]; then did=$(talos-proxy id --home "$home"); else did=$(talosd id --home "$home"); fi
printf '%s\n' "$did" > "$dir/$name.did"

wait_did() {
  i=0
  while [ ! -s "$dir/$1.did" ]; do
    i=$((i + 1)); [ "$i" -gt 120 ] && { echo "no DID published by $1" >&2; exit 1; }
    sleep 1
  done
  cat "$dir/$1.did"
}

case "$role" in
  node)
    args=""
    for peer in "$@"; do args="$args --peer ws://$peer:$port#$(wait_did "$peer")"; done
    # shellcheck disable=SC2086
    exec talosd run --home "$home" --listen "0.0.0.0:$port" --api 127.0.0.1:7401 $args
    ;;
  tool)
    args=""
    for peer in "$@"; do args="$args --allow $(wait_did "$peer")"; done
    # shellcheck disable=SC2086
    exec talos-proxy serve --home "$home" --listen "0.0.0.0:$port" $args -- python -m mcp_server_time
    ;;
  *)
    echo "unknown role: $role" >&2; exit 2
    ;;
esac
