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

Prefect picks the temporary API's port at random in 8000–8999, where stoker serves by default (the demo spec's
8000–8002, the Operate section's 8100–8112, the webhook receiver's 8787): a run started beside a demo or a stack
could take the port that a deployment is about to bind, and did (seen: the webhook receiver failed to start, and
the CI job's POST reached a temporary Prefect API, which answered 404). `place_temporary_api` gives it a port
picked the way stoker picks its own (`stoker.stack.services.free_port`: below the kernel's ephemeral range, free,
and leased, so that no other pick of this host hands it out before the server binds it).

A process that may start the temporary API calls `prepare_temporary_api()` (both of the above) before the flow's
import, and `stop_ephemeral_api()` when its flows are done.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

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


def place_temporary_api() -> None:
    """Keep the temporary API this process may start off the ports stoker serves on by default. Imports Prefect's
    server module (seconds) only when no API is configured, that is when a flow here will start one anyway."""
    from prefect.settings import get_current_settings

    if get_current_settings().api.url:
        return
    from prefect.server.api.server import SubprocessASGIServer

    # prefect 3.8.8 (pinned) draws the port with random.choice from this class attribute, then checks it is free.
    SubprocessASGIServer._port_range = LeasedPort()


def prepare_temporary_api() -> None:
    """What every process that may start Prefect's temporary API does first, before the flow's import starts
    anything of Prefect's: telemetry off (unless the user set it) and the API's port placed. One call, so that a
    new caller cannot take one and forget the other."""
    telemetry_off()
    place_temporary_api()


class LeasedPort(Sequence):
    """One port, picked afresh (and leased) at each draw: the server may start long after this was set."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i):
        if i != 0:
            raise IndexError(i)
        from .services import free_port

        return free_port()


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
