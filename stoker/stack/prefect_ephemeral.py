"""Prefect's temporary API (no PREFECT_API_URL): telemetry off, and stopped on purpose, not in Prefect's
atexit hook.

Prefect's server sends a telemetry heartbeat when it starts (and every 10 minutes); with no network
it logs `ERROR | prefect.server.services.telemetry - Failed to send telemetry`, and on a fresh
database its session row can meet the migration: `sqlite3.OperationalError: database is locked`.
stoker turns it off unless the user said otherwise (`telemetry_off`).

Left to the atexit hook, it is stopped after the program's last line, and it logs "Stopping temporary
server" through Prefect's console handler. Under pytest that handler writes to the capture stream
it was configured with, which pytest has closed by then: `--- Logging error --- … I/O operation on
closed file`. Stopping it here, while the output streams are still open, leaves the hook nothing to do.
"""

from __future__ import annotations

import os
import sys

TELEMETRY_SETTING = "PREFECT_SERVER_ANALYTICS_ENABLED"  # the server's heartbeat and the SDK's events


def telemetry_off() -> bool:
    """Turn Prefect's telemetry off for this process and the servers it starts, unless the user set it
    (environment, profile or prefect.toml); True when this call turned it off. Imports Prefect."""
    if TELEMETRY_SETTING in os.environ:
        return False
    from prefect.context import refresh_global_settings_context
    from prefect.settings import get_current_settings

    if "analytics_enabled" in get_current_settings().server.model_fields_set:  # a profile or toml said so
        return False
    os.environ[TELEMETRY_SETTING] = "false"  # the temporary API's process inherits it
    refresh_global_settings_context()  # settings were read at import; read them again
    return True


def stop_ephemeral_api(timeout_s: float = 10) -> None:
    """Send queued logs and events, then stop every temporary API server this process started."""
    if "prefect" not in sys.modules:  # nothing of Prefect's ran here; importing it costs seconds
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    # Logs and events still queued for the API go first; otherwise their workers retry against the
    # stopped server for a minute at exit.
    APILogWorker.drain_all(timeout=timeout_s)
    EventsWorker.drain_all(timeout=timeout_s)
    # prefect 3.8.8 (pinned) keeps its temporary servers here and stops them in an atexit hook;
    # stop() forgets the process, so that hook then logs nothing. The module is imported only when a
    # temporary server was started: importing it costs seconds (the whole server app), for nothing
    # when the flow ran against a persistent server.
    server_module = sys.modules.get("prefect.server.api.server")
    for server in list(getattr(getattr(server_module, "SubprocessASGIServer", None), "_instances", {}).values()):
        server.stop()
