"""Where stoker keeps this host's state ($STOKER_HOME, default ~/.stoker). A leaf module: anything may import it
(stoker.run re-exports it; storage modules that write under it cannot import stoker.run, which imports them)."""

from __future__ import annotations

import os
from pathlib import Path


def stoker_home() -> Path:
    return Path(os.environ.get("STOKER_HOME", Path.home() / ".stoker")).expanduser().resolve()
