#!/bin/sh
# Container entrypoint for docker-compose.yml.
#
#   talos-entrypoint node NAME PEER...        run a talosd node
#   talos-entrypoint tool NAME ALLOWED...     run talos-proxy serve with mcp-server-time
#   talos-entrypoint agent NAME TOOL          run talos-proxy connect --http to TOOL's server
#   talos-entrypoint natsconf NAME NODE...    write $dir/nats.conf: a NATS relay whose users are NODEs
#
# With TALOS_RELAY=nats://HOST:PORT the node, tool and agent roles open no port:
# a node allows its PEERs and reaches them through the relay by DID, the tool
# serves through the relay, the agent reaches the tool by DID
# (docs/adr/0010-nats-relay.md).
#
# The agent is the MCP client side: its own identity (the tool --allows its DID),
# Streamable HTTP on $TALOS_HTTP_PORT for agents in the compose network, every
# request carrying the bearer token in <its home>/proxy-http.token.
# Each container creates its identity on first start in its own volume
# (/home/talos/node) and publishes its DID to the shared /directory volume;
# peers are wired by address + DID read from there, so every link pins the
# identity it expects.
set -eu
role=$1; name=$2; shift 2
# Overridable so tests can run this script outside a container (on 127.0.0.1).
home=${TALOS_NODE_HOME:-/home/talos/node}
dir=${TALOS_DIRECTORY:-/directory}
bind=${TALOS_BIND:-0.0.0.0}
port=${TALOS_PORT:-7400}
api_port=${TALOS_API_PORT:-7401}
http_port=${TALOS_HTTP_PORT:-7402}
relay=${TALOS_RELAY:-}
# Where peers are dialled: their service name in compose; tests set 127.0.0.1.
peer_host=${TALOS_PEER_HOST:-}
peer_port=${TALOS_PEER_PORT:-$port}

case "$role" in
  node|tool|agent|natsconf) ;;
  *) echo "unknown role: $role (expected node, tool, agent or natsconf)" >&2; exit 2 ;;
esac

# Keys at rest (docs/security.md): with TALOS_PASSPHRASE set (e.g. from a
# compose secret) the identity key is sealed under it and unlocked with it;
# without, this demo stores keys unencrypted, and says so explicitly.
if [ -n "${TALOS_PASSPHRASE:-}" ]; then keyopt=""; else keyopt="--no-passphrase"; fi
if [ "$role" != natsconf ]; then
  if [ ! -f "$home/identity.key" ]; then
    if [ "$role" = node ]; then talosd init --home "$home" $keyopt >/dev/null; else talos-proxy id --home "$home" $keyopt >/dev/null; fi
  fi
  if [ "$role" = node ]; then did=$(talosd id --home "$home"); else did=$(talos-proxy id --home "$home"); fi
  printf '%s\n' "$did" > "$dir/$name.did"
fi

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
    if [ -n "$relay" ]; then
      # No port: peers are allowed by DID and reached through the relay.
      for peer in "$@"; do args="$args --allow $(wait_did "$peer")"; done
      net="--relay $relay"
    else
      for peer in "$@"; do args="$args --peer ws://${peer_host:-$peer}:$peer_port#$(wait_did "$peer")"; done
      net="--listen $bind:$port"
    fi
    # The control API stays on loopback (the node refuses anything else); a fixed
    # port lets the compose healthcheck reach /healthz. `talosd run` has no flag
    # for it, so it goes into the home's config.json (NodeConfig.api_port).
    python - "$home/config.json" "$api_port" <<'PY'
import json, sys
path, port = sys.argv[1], int(sys.argv[2])
with open(path) as f:
    config = json.load(f)
config["api_port"] = port
with open(path, "w") as f:
    json.dump(config, f, indent=2)
PY
    # shellcheck disable=SC2086
    exec talosd run --home "$home" $net $args
    ;;
  tool)
    args=""
    for peer in "$@"; do args="$args --allow $(wait_did "$peer")"; done
    if [ -n "$relay" ]; then net="--relay $relay"; else net="--listen $bind:$port"; fi
    # shellcheck disable=SC2086
    exec talos-proxy serve --home "$home" $net $args -- python -m mcp_server_time
    ;;
  agent)
    [ "$#" -eq 1 ] || { echo "agent takes exactly one tool service" >&2; exit 2; }
    tool_did=$(wait_did "$1")
    if [ -n "$relay" ]; then
      exec talos-proxy connect --home "$home" --relay "$relay" --peer "$tool_did" --http "$bind:$http_port"
    fi
    exec talos-proxy connect --home "$home" --peer "ws://${peer_host:-$1}:$peer_port#$tool_did" \
      --http "$bind:$http_port"
    ;;
  natsconf)
    # Every node of the relay signs in with its own key (nkey); none may read another's subjects.
    dids=""
    for node in "$@"; do dids="$dids $(wait_did "$node")"; done
    # shellcheck disable=SC2086
    talosd relay-config $dids --host "${TALOS_NATS_HOST:-0.0.0.0}" --port "${TALOS_NATS_PORT:-4222}" \
      --store-dir "${TALOS_NATS_STORE:-/data/jetstream}" --monitor-port "${TALOS_NATS_MONITOR:-8222}" \
      > "$dir/nats.conf.tmp"
    mv "$dir/nats.conf.tmp" "$dir/nats.conf"
    ;;
  *)
    echo "unknown role: $role" >&2; exit 2
    ;;
esac
