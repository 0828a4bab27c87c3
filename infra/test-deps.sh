#!/usr/bin/env bash
# Debian packages only the test suite needs (`make test`): PostgreSQL 15 for the self-hosted Prefect stack's
# tests, chromium + chromium-driver for the browser test of the Prefect UI. Idempotent.
set -euo pipefail
missing=()
[ -x /usr/lib/postgresql/15/bin/initdb ] || missing+=(postgresql-15)
command -v chromium >/dev/null || missing+=(chromium)
[ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
# The example CI job (deployments/ci/trigger-build.yml) signs with openssl and builds its body with jq; the
# Operate walk-through test runs it verbatim.
# iproute2: the private-dockerd test gives its daemon a bridge of its own (`ip link`), and fault tests use `tc`.
command -v ip >/dev/null || missing+=(iproute2)
command -v jq >/dev/null || missing+=(jq)
command -v openssl >/dev/null || missing+=(openssl)
command -v curl >/dev/null || missing+=(curl)
[ ${#missing[@]} -eq 0 ] && exit 0
[ "$(id -u)" = 0 ] || { echo "test-deps.sh: need root to apt-get install ${missing[*]}" >&2; exit 1; }
echo "test-deps.sh: installing ${missing[*]} (apt)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null || { echo "test-deps.sh: apt-get update failed" >&2; exit 1; }
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
  || { echo "test-deps.sh: apt-get install ${missing[*]} failed" >&2; exit 1; }
