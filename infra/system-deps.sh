#!/usr/bin/env bash
# Debian packages stoker needs on its host: debootstrap (the image build), gcc and libc6-dev (the argv_secret
# library every backend preloads, stoker/containers/argv_secret.py). Idempotent; Docker itself is infra/dockerd.sh's job.
set -euo pipefail
missing=()
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v cc >/dev/null || missing+=(gcc)
[ -e /usr/include/stdio.h ] || missing+=(libc6-dev)
[ ${#missing[@]} -eq 0 ] && exit 0
[ "$(id -u)" = 0 ] || { echo "system-deps.sh: need root to apt-get install ${missing[*]}" >&2; exit 1; }
echo "system-deps.sh: installing ${missing[*]} (apt)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null || { echo "system-deps.sh: apt-get update failed" >&2; exit 1; }
apt-get install -y -qq "${missing[@]}" >/dev/null || { echo "system-deps.sh: apt-get install ${missing[*]} failed" >&2; exit 1; }
