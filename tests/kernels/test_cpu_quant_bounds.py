"""The quantized CPU kernels (kernels/cpu_quant.py) at the edges of their inputs, on every path:

- No kernel reads past the end of a matrix: each matrix here ends on the last byte before a page
  the process may not read (mprotect PROT_NONE), so a read past it is a SIGSEGV, not a silent
  garbage byte. (The AVX2 GEMV reads each Q4 block's bytes 1 .. 16 with one unaligned load, the
  17th being the next block's; the tile holding a matrix's last row must not.)
- Outputs are bit-identical for any thread count on every path (each output row is summed by one
  thread, whatever the chunking).
- A QuantMatrix survives pickling (its kernel descriptor holds a pointer and is rebuilt).
"""

from __future__ import annotations

import ctypes
import mmap
import pickle

import pytest
import torch

from minisgl.kernels import cpu_quant
from minisgl.kernels.quant_ref import QUANT_TYPES, dequantize_ref
from tests.cpu_build import build
from tests.kernels.test_cpu_quant import (
    PATHS,
    TYPES,
    _need,
    bits,
    check_close,
    random_blocks,
)


@pytest.fixture(scope="module")
def lib() -> cpu_quant.QuantLib:
    return build(cpu_quant.load_library)


PROT_NONE = 0  # <sys/mman.h>; the mmap module exports only PROT_READ, PROT_WRITE, PROT_EXEC


class Guarded:
    """`nbytes` of writable memory ending where an unreadable page begins."""

    def __init__(self, nbytes: int) -> None:
        page = mmap.PAGESIZE
        self.total = (nbytes + page - 1) // page * page + page
        self.map = mmap.mmap(-1, self.total, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = (ctypes.c_char * self.total).from_buffer(self.map)  # pins the map, gives its address
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.mprotect(ctypes.addressof(self._view) + self.total - page, page, PROT_NONE) != 0:
            pytest.skip(f"mprotect failed (errno {ctypes.get_errno()})")
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=self.total - page - nbytes)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("name", TYPES)
def test_no_read_past_the_matrix(lib: cpu_quant.QuantLib, isa: str, name: str) -> None:
    _need(lib, isa)
    q = QUANT_TYPES[name]
    for n, k in ((1, q.block_size), (5, 2 * q.block_size), (37, 3 * q.block_size)):
        weight = random_blocks(q, n, k, seed=7 * n + k)
        guard = Guarded(weight.numel())
        guard.tensor.copy_(weight.reshape(-1))
        w_end = guard.tensor.view(n, -1)
        assert w_end.data_ptr() + w_end.numel() == ctypes.addressof(guard._view) + guard.total - mmap.PAGESIZE
        w = dequantize_ref(weight, name)
        for m, mode in ((1, "gemv"), (2, "gemv"), (5, "gemv"), (13, "gemm")):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            for threads in (1, 2):
                before = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    y = lib.matmul(x, w_end, name, isa, mode)  # type: ignore[arg-type]
                finally:
                    torch.set_num_threads(before)
                check_close(y, x, w)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_gemv_bit_identical_across_thread_counts_every_path(lib: cpu_quant.QuantLib, isa: str, name: str) -> None:
    _need(lib, isa)
    q = QUANT_TYPES[name]
    weight = random_blocks(q, 203, 768 if q.block_size == 256 else 576, seed=11)
    x = torch.randn(3, weight.shape[1] // q.type_size * q.block_size)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(lib.matmul(x, weight, name, isa, "gemv"))  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(bits(outs[0]), bits(o)) for o in outs[1:])


def test_quant_matrix_pickles(lib: cpu_quant.QuantLib) -> None:
    weight = random_blocks(QUANT_TYPES["Q4_1"], 9, 64, seed=3)
    qm = cpu_quant.QuantMatrix.create(weight, "Q4_1")
    back = pickle.loads(pickle.dumps(qm))
    assert (back.n, back.k, back.qtype) == (qm.n, qm.k, qm.qtype)
    assert back.desc[1] == back.weight.data_ptr() != qm.desc[1]
    x = torch.randn(2, 64)
    assert torch.equal(cpu_quant.quant_linear(x, back), cpu_quant.quant_linear(x, qm))
