"""What the extend and decode kernels share: the online-softmax step over one block of keys,
the block and precision choices, the layout checks.

The extend kernel's bulk path (`_bulk_loop`: whole key blocks every query of the block sees, with
no mask, read through the table, at a run's affine slots or through TMA descriptors) is here too.

Per layer, two compile-time switches change the step: SOFTCAP runs the scores through
`cap * tanh(s / cap)` before softmax (Gemma 2), and the callers' WINDOWED masks keys that slid out
of a sliding window (and skips the blocks wholly outside it). With both off the kernels compile to
the plain causal code, so the tuned launches stay what they measured.

Both kernels reach K/V only through the token table (`token_table[row, pos]` is the slot of
position `pos`), so page size never matters here and the new tokens' K/V are read the same way as
the prefix once the backend has stored them. Softmax runs in base 2 (`exp2`) with `sm_scale * log2 e`
folded into the scores, accumulating in fp32. The plain-torch oracle is `kernels/attention_ref.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    k_head_ptr,
    v_head_ptr,
    table_row_ptr,
    kv_pos,
    kv_mask,
    score_mask,
    offs_d,
    d_mask,
    stride_ks,
    stride_vs,
    qk_scale,
    cap_scale,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    V_STAGED: tl.constexpr = False,
):
    """One online-softmax step over a block of key positions; returns the updated (acc, m, l).

    Scores come out in base 2: `dot * qk_scale` (qk_scale = sm_scale * log2 e), or with SOFTCAP
    `tanh(dot * qk_scale) * cap_scale` (qk_scale = sm_scale / cap, cap_scale = cap * log2 e).

    V_STAGED (a float8 cache): v is widened in the registers it was loaded to, then multiplied by
    its row mask (exact: 1 or 0). The multiply keeps the compiler from moving the widening past
    the shared-memory load of the dot operand: an 8-bit [keys, D] tile read as the transposed
    operand of p @ v is read byte by byte (sm90 has no 8-bit ldmatrix.trans), where the widened
    16-bit tile takes ldmatrix.trans (decode.py's note on float8)."""
    # int64 before scaling by the slot stride: large pools overflow int32 element offsets.
    slots = tl.load(table_row_ptr + kv_pos, mask=kv_mask, other=0).to(tl.int64)
    kv_load_mask = kv_mask[:, None] & d_mask[None, :]
    # .to(q.dtype): a float8 cache is widened in registers (a no-op when the cache is q's dtype).
    k = tl.load(k_head_ptr + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_load_mask, other=0.0).to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if SOFTCAP:
        scores = _tanh(scores) * cap_scale
    scores = tl.where(score_mask, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row that has seen no key yet keeps m = -inf; shift by 0 instead so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(scores - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_head_ptr + slots[:, None] * stride_vs + offs_d[None, :], mask=kv_load_mask, other=0.0).to(q.dtype)
    if V_STAGED:
        v = v * kv_mask.to(q.dtype)[:, None]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _softmax_pv(acc, m_i, l_i, dots, v, qk_scale, cap_scale, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """`_attend_block`'s online-softmax step on a block whose every key is visible to every row,
    from its raw q.k `dots` and v (q's dtype): no mask, and no -inf guard (the scores are finite)."""
    scores = dots * qk_scale
    if SOFTCAP:
        scores = _tanh(scores) * cap_scale
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _bulk_tile(
    start, desc, head_ptr, table_row_ptr, base, kv_head, offs_n, offs_d, d_mask, stride,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SOURCE: tl.constexpr,
):  # fmt: skip
    """Keys [start, start + BLOCK_N) of one KV head, all inside the sequence: SOURCE 0 through the
    token table, 1 at slots base + pos, 2 through the TMA descriptor (the cache as [slots, Hkv * D])."""
    if SOURCE == 2:
        x = desc.load([base + start, kv_head * HEAD_DIM])
    else:
        if SOURCE == 1:
            rows = (base + start + offs_n).to(tl.int64)
        else:
            rows = tl.load(table_row_ptr + start + offs_n).to(tl.int64)
        ptrs = head_ptr + rows[:, None] * stride + offs_d[None, :]
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
    return x


@triton.jit
def _bulk_loop(
    acc, m_i, l_i, q, k_desc, v_desc, k_head_ptr, v_head_ptr, table_row_ptr, base, kv_head, bulk_end, offs_n,
    offs_d, d_mask, stride_ks, stride_vs, qk_scale, cap_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, SOURCE: tl.constexpr,
):  # fmt: skip
    """Keys [0, bulk_end) (whole blocks, all visible), read from SOURCE (`_bulk_tile`)."""
    for start in range(0, bulk_end, BLOCK_N):
        k = _bulk_tile(start, k_desc, k_head_ptr, table_row_ptr, base, kv_head, offs_n, offs_d, d_mask, stride_ks,
                       HEAD_DIM, BLOCK_D, SOURCE).to(q.dtype)  # fmt: skip
        v = _bulk_tile(start, v_desc, v_head_ptr, table_row_ptr, base, kv_head, offs_n, offs_d, d_mask, stride_vs,
                       HEAD_DIM, BLOCK_D, SOURCE).to(q.dtype)  # fmt: skip
        dots = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        acc, m_i, l_i = _softmax_pv(acc, m_i, l_i, dots, v, qk_scale, cap_scale, PRECISION, SOFTCAP)
    return acc, m_i, l_i


@triton.jit
def _tanh(x):
    """tanh without libdevice (the interpreter has none): sign(x) (1 - e^-2|x|) / (1 + e^-2|x|),
    which never overflows, for |x| >= 0.3; below, where 1 - e^-2|x| would cancel (a relative error
    of 3e-5 at |x| = 1e-3, and scores over Gemma 2's cap of 50 sit there), its Taylor series to
    x^11 (truncation under 1e-9 relative)."""
    t = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
    y = (1.0 - t) / (1.0 + t)
    big = tl.where(x < 0, -y, y)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0 - x2 * (1382.0 / 155925.0))))))
    return tl.where(tl.abs(x) < 0.3, small, big)


def is_interpreted() -> bool:
    """True when the kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_attend_block).__name__ == "InterpretedFunction"


# The interpreter's tl.dot is a slow generic numpy matmul, so its cost is the padded block volume:
# minimal blocks keep CPU tests fast. On the GPU the sizes below are picked for tensor cores.
_SMALL_BLOCKS = is_interpreted()


def _block_d(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16; other head dims are padded and masked.
    return max(16, triton.next_power_of_2(head_dim))


def _precision(dtype: torch.dtype) -> str:
    # fp32 caches are the accuracy reference: keep fp32 dots exact instead of tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _score_scales(sm_scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, cap_scale) for `_attend_block`: base-2 scores, soft-capped when `softcap` is set."""
    if softcap is None:
        return sm_scale * _LOG2E, 0.0
    assert softcap > 0, softcap
    return sm_scale / softcap, softcap * _LOG2E


def _check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    assert q.dim() == 3 and k_cache.dim() == 3 and v_cache.shape == k_cache.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    assert k_cache.shape[2] == head_dim and num_heads % num_kv_heads == 0
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    # The cache is q's dtype, or float8 (its scales passed as k_scale / v_scale).
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
    return num_heads, num_kv_heads, head_dim
