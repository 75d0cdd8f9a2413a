"""Which rounding does the Triton rotary kernel do on this GPU? Compares it in bf16 with the
reference (each product and the sum rounded, as eager torch/HF) and with single rounding (fp32
math, one rounding at the end). `python tools/diag_rotary.py`

Research tool, not product code. Findings: docs/performance.md, "Known gap" (the fused rotary
kernel's rounding).
"""

import torch

from minisgl.kernels.rotary import rotary
from minisgl.kernels.rotary_ref import rotary_ref
from minisgl.layers.rotary import RotaryEmbedding

torch.manual_seed(11)
dev, dtype = "cuda", torch.bfloat16
rope = RotaryEmbedding(64, 4096, 1e6, None, impl="torch").to(dev)
for tokens in (1, 333):
    q = torch.randn(tokens, 16, 64, device=dev).to(dtype)
    k = torch.randn(tokens, 8, 64, device=dev).to(dtype)
    pos = torch.randint(0, 4096, (tokens,), device=dev)
    qo, _ = rotary(pos, q, k, rope.cos, rope.sin)
    qr, _ = rotary_ref(pos, q, k, rope.cos, rope.sin)
    # single rounding, fp32 table
    c = rope.cos[pos].unsqueeze(1)
    s = rope.sin[pos].unsqueeze(1)
    x1, x2 = q.float().chunk(2, -1)
    single = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(dtype)
    # single rounding, bf16-rounded table
    cb, sb = c.to(dtype).float(), s.to(dtype).float()
    single_b = torch.cat([x1 * cb - x2 * sb, x2 * cb + x1 * sb], -1).to(dtype)
    # fma: round(round(x1*c) + x2*s)
    fma_b = torch.cat([((x1 * cb).to(dtype).float() - x2 * sb), ((x2 * cb).to(dtype).float() + x1 * sb)], -1).to(dtype)
    for name, other in [("ref", qr), ("single fp32 table", single), ("single bf16 table", single_b), ("one product rounded", fma_b)]:
        print(f"tokens={tokens} kernel vs {name}: {(qo != other).float().mean().item():.2%} differ")
    print(f"tokens={tokens} ref vs single bf16 table: {(qr != single_b).float().mean().item():.2%} differ")
