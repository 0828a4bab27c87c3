"""Extra `stoker` subcommands, one module each.

A module here defines `register(sub)` that adds its parser(s) to argparse's
subparsers with `set_defaults(fn=handler)`; a handler returns the exit code and
raises StokerError for a one-line failure. List the module in MODULES.
"""

MODULES: list[str] = ["deploy_flows", "webhook", "rollback", "status", "bench", "render", "cache", "prune", "keys", "reconcile",
                     "sync_repo"]
