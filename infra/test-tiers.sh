#!/usr/bin/env bash
# `make test`'s two tiers, side by side. The fast tier is one pytest process: run first, on its own, it kept one of
# this machine kind's two cores idle for its whole minute and a half (benchmarks/results/suite_cpu.json). Beside
# the service tier it fills the idle core instead, and the service tier keeps its own output on the terminal.
# The fast tier's output is kept in a file and printed whole when it ends, so the two never interleave; if it
# fails, the service tier is interrupted (SIGINT: pytest runs its teardowns, as for Ctrl-C) and `make test` fails
# with the fast tier's status. Usage: infra/test-tiers.sh (run by `make test`; MAKE names the make to call).
set -uo pipefail
make=${MAKE:-make}
log=$(mktemp -t stoker-fast-tier.XXXXXX)
trap 'rm -f "$log"' EXIT

# Job control: the service tier runs in a process group of its own (its id is $!), so that the whole tier (make,
# pytest, its xdist workers) can be interrupted at once; and without it a script's background job starts with
# SIGINT ignored, which Python (and so pytest) then never turns into KeyboardInterrupt.
set -m
"$make" --no-print-directory test-services &
services=$!
interrupt() { kill -INT -- "-$services" 2>/dev/null; }
trap 'interrupt; wait "$services"; exit 130' INT TERM

echo "tier fast: running beside the service tier; its output follows when it ends"
"$make" --no-print-directory test-fast >"$log" 2>&1
fast=$?
printf '\n'
cat "$log"
if [ "$fast" -ne 0 ]; then
    echo "make test: the fast tier failed (exit $fast); interrupting the service tier" >&2
    interrupt
    wait "$services"
    exit "$fast"
fi
wait "$services"
