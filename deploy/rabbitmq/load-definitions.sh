#!/usr/bin/env bash
# Load the nllb-worker broker topology (queues, dead-letter exchange, binding, policies) into a
# running RabbitMQ by hand. Idempotent: re-running it changes nothing that is already right.
#
#   deploy/rabbitmq/load-definitions.sh [DEFINITIONS_FILE]
#
# Tries, in order:
#   1. rabbitmqctl import_definitions FILE   (on the broker host, or with RABBITMQ_NODENAME /
#      RABBITMQCTL_ARGS set for a remote node and the Erlang cookie; no management plugin needed)
#   2. rabbitmqadmin import FILE             (HTTP management API; set RABBITMQ_HOST,
#      RABBITMQ_MGMT_PORT, RABBITMQ_USER, RABBITMQ_PASS, RABBITMQ_VHOST as needed)
# Force one with LOAD_WITH=rabbitmqctl or LOAD_WITH=rabbitmqadmin.
#
# The file holds no users: on a production broker create the worker's user yourself and grant it
# configure/write/read on the vhost (the worker declares the same queues; declaring is idempotent).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
file="${1:-$here/definitions.json}"
with="${LOAD_WITH:-auto}"

if [[ ! -r "$file" ]]; then
  echo "load-definitions: cannot read definitions file '$file'" >&2
  exit 2
fi
# rabbitmqctl resolves relative paths on the node's side: always hand it an absolute one.
file="$(cd "$(dirname "$file")" && pwd)/$(basename "$file")"

use_rabbitmqctl() {
  # shellcheck disable=SC2086
  rabbitmqctl ${RABBITMQCTL_ARGS:-} import_definitions "$file"
}

use_rabbitmqadmin() {
  rabbitmqadmin \
    --host="${RABBITMQ_HOST:-127.0.0.1}" --port="${RABBITMQ_MGMT_PORT:-15672}" \
    --username="${RABBITMQ_USER:-guest}" --password="${RABBITMQ_PASS:-guest}" \
    --vhost="${RABBITMQ_VHOST:-/}" \
    import "$file"
}

case "$with" in
  rabbitmqctl) use_rabbitmqctl ;;
  rabbitmqadmin) use_rabbitmqadmin ;;
  auto)
    if command -v rabbitmqctl >/dev/null 2>&1 && rabbitmqctl ${RABBITMQCTL_ARGS:-} -q status >/dev/null 2>&1; then
      use_rabbitmqctl
    elif command -v rabbitmqadmin >/dev/null 2>&1; then
      use_rabbitmqadmin
    else
      echo "load-definitions: neither a reachable rabbitmqctl nor rabbitmqadmin was found." >&2
      echo "  Install rabbitmqadmin (it needs the rabbitmq_management plugin on the broker)," >&2
      echo "  or run this on the broker host, or POST the file to http://HOST:15672/api/definitions." >&2
      exit 2
    fi
    ;;
  *)
    echo "load-definitions: LOAD_WITH='$with' is not one of auto, rabbitmqctl, rabbitmqadmin" >&2
    exit 2
    ;;
esac

echo "load-definitions: loaded $file"
