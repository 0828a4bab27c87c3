#!/usr/bin/env bash
# Ask stoker to build a model revision: the signed POST a CI job makes (trigger-build.yml runs this file).
# Needs jq, python3, curl, and in the environment:
#   STOKER_WEBHOOK_URL     e.g. https://stoker.example.com/hooks/build
#   STOKER_WEBHOOK_SECRET  the receiver's secret (`stoker webhook serve`)
#   STOKER_WEBHOOK_CA      optional: a CA file that signed the receiver's certificate (one curl does not trust)
#   REVISION               branch, tag or sha to build
#   GITHUB_RUN_ID          the CI run: its id is the idempotency key, so a re-run of the job gets the first
#                          run back (202, duplicate: true) instead of starting another build
#   STOKER_SPEC, STOKER_REPO   optional: the spec's name in the receiver's specs folder, and its model repo
# The body is signed with HMAC-SHA256 over its exact bytes (header X-Hub-Signature-256, as GitHub's own webhooks
# do); `timestamp` inside the signed body bounds replays.
set -euo pipefail
body=$(jq -cn --arg rev "$REVISION" --arg spec "${STOKER_SPEC:-example-full}" \
  --arg repo "${STOKER_REPO:-stoker/tiny-llama}" --arg key "ci-${GITHUB_RUN_ID}" \
  '{spec: $spec, repo: $repo, revision: $rev, idempotency_key: $key, timestamp: now|floor}')
# HMAC in python3, the secret read from the environment: a command-line argument (openssl -hmac) is readable by every
# user of the host in /proc/<pid>/cmdline while it runs; a process's environment is not.
sig=$(printf '%s' "$body" | python3 -c 'import hashlib, hmac, os, sys
print(hmac.new(os.environb[b"STOKER_WEBHOOK_SECRET"], sys.stdin.buffer.read(), hashlib.sha256).hexdigest())')
ca=()
if [ -n "${STOKER_WEBHOOK_CA:-}" ]; then ca=(--cacert "$STOKER_WEBHOOK_CA"); fi
# --retry-connrefused: a receiver that is (re)starting is waited for, not failed; the key makes a retry safe.
code=$(curl -sS "${ca[@]}" --retry 30 --retry-delay 1 --retry-connrefused -o "${TMPDIR:-/tmp}/stoker-answer.json" -w '%{http_code}' -X POST "$STOKER_WEBHOOK_URL" \
  -H 'Content-Type: application/json' -H "X-Hub-Signature-256: sha256=$sig" --data-binary "$body")
cat "${TMPDIR:-/tmp}/stoker-answer.json"; echo
# 202 started (or, for a key already used with the same spec/repo/revision, the first run: duplicate true);
# 401 bad signature/stale, 400 bad trigger, 409 key used for another trigger, 413 too big, 429 slow down.
test "$code" = 202
