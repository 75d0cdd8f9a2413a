"""Profile the host side of the offline benchmark: `python scripts/profile_offline.py [bench args]`.

Runs `python -m minisgl.bench offline` under cProfile and prints the functions with the most own
time, which is where per-step Python overhead shows up on a GPU (the device work is async)."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

from minisgl.bench.offline import main

profiler = cProfile.Profile()
profiler.enable()
main(sys.argv[1:])
profiler.disable()
out = io.StringIO()
pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(35)
print(out.getvalue())
