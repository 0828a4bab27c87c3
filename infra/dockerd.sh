#!/bin/bash
# Makes sure a Docker daemon answers on this machine. Idempotent: exits 0 at once
# when one already answers; otherwise installs Debian's docker.io if dockerd is
# missing, starts dockerd in the background and waits (60 s) for its socket.
#
# Env: DOCKER_HOST     unix:///path.sock to use another socket (default /var/run/docker.sock)
#      DOCKERD_LOG     log file (default $STOKER_HOME/dockerd.log, else /var/log/stoker-dockerd.log)
#      DOCKERD_PIDFILE written with the pid of a daemon this script started
#      DOCKERD_EXTRA_ARGS extra dockerd flags (word-split), e.g. a separate --data-root
# Exits non-zero with a one-line cause on stderr.
set -euo pipefail

fail() { echo "dockerd.sh: $*" >&2; exit 1; }

sock=/var/run/docker.sock
case "${DOCKER_HOST:-}" in
    "") ;;
    unix://*) sock=${DOCKER_HOST#unix://} ;;
    *) fail "DOCKER_HOST=$DOCKER_HOST is not a local unix socket; start that daemon where it runs" ;;
esac
if [ -n "${DOCKERD_LOG:-}" ]; then log=$DOCKERD_LOG
elif [ -n "${STOKER_HOME:-}" ]; then log=$STOKER_HOME/dockerd.log
else log=/var/log/stoker-dockerd.log; fi

answers() {
    [ -S "$sock" ] || return 1
    if command -v docker >/dev/null; then
        docker -H "unix://$sock" info >/dev/null 2>&1
    elif command -v curl >/dev/null; then
        curl -sf --max-time 5 --unix-socket "$sock" http://docker/_ping >/dev/null
    else
        return 1
    fi
}

if answers; then
    exit 0
fi

[ "$(id -u)" = 0 ] || fail "no daemon answers on $sock and starting one needs root"

if ! command -v dockerd >/dev/null; then
    echo "dockerd.sh: installing docker.io (apt)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null 2>&1 || fail "apt-get update failed"
    apt-get install -y -qq docker.io >/dev/null 2>&1 || fail "apt-get install docker.io failed"
fi

mkdir -p "$(dirname "$log")"
echo "dockerd.sh: starting dockerd on $sock (log $log)" >&2
# shellcheck disable=SC2086  # DOCKERD_EXTRA_ARGS is a flag list on purpose
nohup dockerd -H "unix://$sock" ${DOCKERD_EXTRA_ARGS:-} >>"$log" 2>&1 </dev/null &
pid=$!
if [ -n "${DOCKERD_PIDFILE:-}" ]; then
    mkdir -p "$(dirname "$DOCKERD_PIDFILE")"
    echo "$pid" >"$DOCKERD_PIDFILE"
fi

for _ in $(seq 1 120); do
    if answers; then
        exit 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
        [ -n "${DOCKERD_PIDFILE:-}" ] && rm -f "$DOCKERD_PIDFILE"
        fail "dockerd exited: $(grep -v '^\s*$' "$log" | tail -n 1)"
    fi
    sleep 0.5
done
fail "dockerd (pid $pid) did not answer on $sock within 60 s; see $log"
