"""Cold build time of every C++ CPU extension: `python tools/cpu_build_time.py`. Builds the float
CPU kernels (kernels/cpp_ext.py: the library every CPU run loads) and the quantized GEMV/GEMM
kernels (kernels/cpu_quant.py) into an empty cache directory, in a fresh process as the first
start of a server does, and prints the wall time and the compiler's CPU time (on a shared, busy
machine the wall time overstates what an idle one takes; CPU time / cores is the idle estimate).

Research tool, not product code. Findings: docs/performance.md, section "C++ decode attention on
CPU" (the cold build).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time

STEPS = {
    "float kernels (cpp_ext)": "from minisgl.kernels import cpp_ext; cpp_ext.load_library()",
    "quantized kernels (cpu_quant)": "from minisgl.kernels import cpu_quant; cpu_quant.load_library()",
}
WARM = "import torch, torch.utils.cpp_extension; import minisgl.kernels.cpp_ext, minisgl.kernels.cpu_quant"


def timed(code: str, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and its children: the compilers) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "MINISGL_CACHE_DIR": cache, "PYTHONPATH": os.getcwd()}
        base_wall, base_cpu = timed(WARM, env)  # the imports alone, subtracted below
        print(f"cores: {os.cpu_count()}; load average: {', '.join(f'{x:.1f}' for x in os.getloadavg())}; "
              f"import overhead {base_wall:.1f} s wall, {base_cpu:.1f} s CPU (subtracted)")  # fmt: skip
        total_wall = total_cpu = 0.0
        for name, code in STEPS.items():
            wall, cpu = timed(code, env)
            wall, cpu = wall - base_wall, cpu - base_cpu
            total_wall, total_cpu = total_wall + wall, total_cpu + cpu
            print(f"{name:<32} cold build {wall:6.1f} s wall, {cpu:6.1f} s CPU")
        cached_wall, _ = timed(";".join(STEPS.values()), env)
        print(f"{'all CPU extensions':<32} cold build {total_wall:6.1f} s wall, {total_cpu:6.1f} s CPU "
              f"(~{total_cpu / (os.cpu_count() or 1):.1f} s on idle cores); cached load "
              f"{max(cached_wall - base_wall, 0.0):.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
