"""Prefect's temporary API (no PREFECT_API_URL): stop it on purpose, not in Prefect's atexit hook.

Left to that hook, it is stopped after the program's last line, and it logs "Stopping temporary
server" through Prefect's console handler. Under pytest that handler writes to the capture stream
it was configured with, which pytest has closed by then: `--- Logging error --- … I/O operation on
closed file`. Stopping it here, while the output streams are still open, leaves the hook nothing to do.
"""

from __future__ import annotations

import sys


def stop_ephemeral_api(timeout_s: float = 10) -> None:
    """Send queued logs and events, then stop every temporary API server this process started."""
    if "prefect" not in sys.modules:  # nothing of Prefect's ran here; importing it costs seconds
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer

    # Logs and events still queued for the API go first; otherwise their workers retry against the
    # stopped server for a minute at exit.
    APILogWorker.drain_all(timeout=timeout_s)
    EventsWorker.drain_all(timeout=timeout_s)
    # prefect 3.8.8 (pinned) keeps its temporary servers here and stops them in an atexit hook;
    # stop() forgets the process, so that hook then logs nothing.
    for server in list(getattr(SubprocessASGIServer, "_instances", {}).values()):
        server.stop()
