from __future__ import annotations

import logging
import sys

from minisgl.env import ENV

_CONFIGURED = False


def get_logger(name: str) -> logging.Logger:
    global _CONFIGURED
    if not _CONFIGURED:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("[%(asctime)s %(process)d %(name)s] %(levelname)s %(message)s", "%H:%M:%S")
        )
        root = logging.getLogger("minisgl")
        root.addHandler(handler)
        root.setLevel(ENV.log_level)
        root.propagate = False
        _CONFIGURED = True
    if not name.startswith("minisgl"):
        name = f"minisgl.{name}"
    return logging.getLogger(name)
