"""utils/memory.trim_heap: freed malloc pages inside the heap go back to the system (what the
tokenizer and detokenizer processes call after loading their tokenizer)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

CHILD = r"""
import re
from minisgl.utils.memory import trim_heap
def rss():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024
blocks = [bytes(2048) for _ in range(40_000)]  # ~80 MiB of malloc'd (not pymalloc) objects
keep = blocks[::64]  # one in 64 stays: the heap cannot shrink from its top
del blocks
before = rss()
assert trim_heap()
print(before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_heap_returns_free_pages_and_imports_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD + "import sys; assert 'torch' not in sys.modules\n"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    released = float(out.stdout.strip())
    assert released > 40, f"trim released {released:.1f} MiB of ~78 free"
