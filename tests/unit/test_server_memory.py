"""What a CPU server's processes hold: the KV pool in host memory is committed page by page as
requests write it, not at start-up; a CPU engine never imports triton (~50 MB mapped)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from minisgl.kvcache.latent_pool import LatentPool
from minisgl.kvcache.pool import KVPool, zeroed_buffers
from minisgl.utils.memory import trim_heap
from tests.tiny_models import make_tiny_model


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_pool_memory_is_committed_on_write() -> None:
    # 4 layers x (K + V) x 2049 pages x 16 slots x 4 heads x 128 x 4 B = 256 MiB of fp32 pages.
    trim_heap()  # free heap pages malloc might hand back mid-test would hide part of the growth
    before = _rss_anon_mib()
    pool = KVPool(4, 2048, 16, 4, 128, torch.float32, torch.device("cpu"))
    assert _rss_anon_mib() - before < 32  # torch.zeros would have committed all 256 MiB here
    loc = torch.arange(16 * 64, dtype=torch.int64)  # 64 pages of every layer: 16 MiB in all
    for layer in range(4):
        pool.store(layer, loc, torch.ones(len(loc), 4, 128), torch.ones(len(loc), 4, 128))
    grown = _rss_anon_mib() - before
    assert 16 <= grown < 80, grown
    assert all(float(t.sum()) == len(loc) * 4 * 128 for t in pool.k + pool.v)  # the rest still reads zero


def test_zeroed_buffers_are_zero_separate_and_contiguous() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        buffers = zeroed_buffers(3, (40, 2, 8), dtype, torch.device("cpu"))
        assert [tuple(b.shape) for b in buffers] == [(40, 2, 8)] * 3
        assert all(b.dtype == dtype and b.is_contiguous() for b in buffers)
        assert all(not b.view(torch.uint8).any() for b in buffers)
        buffers[1].view(torch.uint8).fill_(7)
        assert not buffers[0].view(torch.uint8).any() and not buffers[2].view(torch.uint8).any()
    assert zeroed_buffers(2, (0, 4), torch.float32, torch.device("cpu"))[1].shape == (0, 4)


def test_latent_pool_reads_zero_and_stores() -> None:
    pool = LatentPool(2, 8, 4, 16, 8, torch.float32, torch.device("cpu"))
    assert not any(bool(t.any()) for t in pool.latent)
    pool.store_latent(1, torch.tensor([3]), torch.ones(1, 24))
    assert float(pool.latent[1].sum()) == 24 and float(pool.latent[0].sum()) == 0
    assert pool.k[1].data_ptr() == pool.latent[1].data_ptr()


def test_cpu_engine_imports_no_triton(tmp_path: Path) -> None:
    make_tiny_model("llama", tmp_path)  # here: transformers imports triton itself
    code = (
        "import sys\n"
        "from minisgl import LLM, SamplingParams\n"
        f"llm = LLM({str(tmp_path)!r}, device='cpu', dtype='float32', num_pages=64, max_running_requests=4)\n"
        "out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 4\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('triton', 'transformers')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_cpu_platform_returns_freed_heap_when_idle() -> None:
    from minisgl.platform.cpu import CpuPlatform
    from minisgl.utils.memory import _libc

    assert _libc("malloc_trim") is not None  # glibc (the CI's and this project's machines)
    big = torch.ones(20 << 18)  # 20 MiB, mmapped and freed: malloc's mmap threshold rises past 10 MiB
    del big
    held = [torch.ones(10 << 18) for _ in range(24)]  # 24 x 10 MiB, now from the heap
    keep = held.pop()  # the top chunk stays in use, so freeing the rest cannot shrink the heap's end
    held.clear()
    before = _rss_anon_mib()
    CpuPlatform().release_idle_memory()
    assert before - _rss_anon_mib() > 150, (before, _rss_anon_mib())
    assert float(keep[0]) == 1.0
