"""The environment variables minisgl reads, typed. Every one is read here, nowhere else.

Only what belongs to the machine or the deployment lives here: the API key (a secret, kept out of
the command line), the cache directory, the log level and the CPU thread count, plus Triton's own
TRITON_INTERPRET. Everything that changes what the engine computes or how it schedules is a
config field with a command-line flag (`python -m minisgl --help`, server/engine_args.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# The server's key when --api-key is not given.
API_KEY_VAR = "MINISGL_API_KEY"


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return default if raw is None or raw == "" else int(raw)


@dataclass(frozen=True)
class Env:
    api_key: str | None  # MINISGL_API_KEY: the server's key when --api-key is not given
    cache_dir: Path  # MINISGL_CACHE_DIR: downloaded models (default $XDG_CACHE_HOME/minisgl)
    log_level: str  # MINISGL_LOG_LEVEL (default INFO)
    num_threads: int  # MINISGL_NUM_THREADS: torch's CPU threads; 0: let torch decide
    triton_interpret: bool  # TRITON_INTERPRET (Triton's own): its kernels run on the CPU, interpreted

    @staticmethod
    def read() -> "Env":
        default_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minisgl"
        return Env(
            api_key=os.environ.get(API_KEY_VAR) or None,
            cache_dir=Path(os.environ.get("MINISGL_CACHE_DIR", default_cache)),
            log_level=os.environ.get("MINISGL_LOG_LEVEL", "INFO").upper(),
            num_threads=_int("MINISGL_NUM_THREADS", 0),
            triton_interpret=_bool("TRITON_INTERPRET", False),
        )


ENV = Env.read()
