#!/usr/bin/env bash
# The HTTPRoute validator's packages (package-lock.json) for stoker/kubernetes/validate.py; `make venv-dev` runs this
# only when package.json or the lock changed. Node and npm from Debian when missing (Debian 12: node 18; the package
# declares node >= 22 but its generated validators need nothing newer, npm only warns).
set -euo pipefail
cd "$(dirname "$0")"
missing=()
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "infra/kubernetes/install.sh: need root to apt-get install ${missing[*]}" >&2; exit 1; }
  echo "infra/kubernetes/install.sh: installing ${missing[*]} (apt)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || { echo "infra/kubernetes/install.sh: apt-get install ${missing[*]} failed" >&2; exit 1; }
fi
npm ci --no-audit --no-fund --loglevel=error
