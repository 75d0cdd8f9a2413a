"""The MoE kernels compiled for sm_90 without a GPU (issue 28): registers, stack spill, shared
memory and the K loop's async (pipelined) loads of the fused expert GEMMs per tiling, from the
cubin (`cuobjdump -res-usage` of the ptxas bundled with triton), and a compile of the routing and
align kernels. CPU only, ~30 s.

The compile specializes as a launch on real tensors does (16-byte aligned pointers, strides
that are multiples of 16: `_divisibility`). The first version of this tool did not, and reported
what no launch runs: no vectorized loads, no pipelining (stages 2 and 3 the same 16 KiB of shared
memory), gate_up at BLOCK_M 64 and 4 warps at 255 registers spilling 528 B a thread. Specialized
(triton 3.6), no tiling here spills: that default uses 122 registers, 48 KiB of shared memory and
6 async loads in its K loop; the routing kernel 80 registers at 16 tokens a program (146 at 32).
tools/bench_moe_tiles.py times the tilings on the GPU.

    python tools/bench_moe_sass.py

Findings: docs/performance.md, "Profiles of the large shapes" (the MoE tiles' registers and spills).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minisgl.kernels import moe, moe_routing

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
STRIDES = {k: "i32" for k in ["stride_xt", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_be", "stride_ot"]}
CONFIGS = [(64, 64, 64, 4, 2), (64, 64, 64, 8, 2), (64, 64, 64, 8, 3), (64, 128, 64, 8, 3), (128, 64, 64, 8, 3),
           (128, 128, 64, 8, 4), (32, 64, 64, 4, 3), (32, 128, 128, 4, 2), (16, 64, 64, 4, 3), (16, 64, 128, 4, 3),
           (16, 128, 128, 4, 2), (64, 64, 32, 4, 3)]  # fmt: skip


def _ptr(dtype: str) -> str:
    return "*" + dtype


def _divisibility(fn: object, signature: dict[str, str]) -> dict[tuple[int, ...], list[list[object]]]:
    """What a launch specializes on for real tensors: 16-byte aligned pointers and strides that
    are multiples of 16 (all of them at these shapes). Without it nothing vectorizes, the K loop's
    loads are not pipelined (no async copies) and the registers and spills are not the GPU's."""
    names = fn.arg_names  # type: ignore[attr-defined]
    return {(names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
            if kind.startswith("*") or name.startswith("stride")}  # fmt: skip


def resources(fn: object, signature: dict[str, str], constants: dict[str, object], warps: int, stages: int) -> str:
    attrs = _divisibility(fn, signature)
    signature = {**signature, **{name: "constexpr" for name in constants}}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=attrs), target=TARGET,
                            options={"num_warps": warps, "num_stages": stages})  # fmt: skip
    asyncs = kernel.asm["ttgir"].count("async_copy_global_to_local")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(CUOBJDUMP), "-res-usage", cubin.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return (f"regs {regs.group(1) if regs else '?'} stack {stack.group(1) if stack else '?'} B shared "
            f"{kernel.metadata.shared} B async loads {asyncs}")  # fmt: skip


def main() -> None:
    route = {"logits_ptr": _ptr("bf16"), "weights_ptr": _ptr("bf16"), "ids_ptr": _ptr("i64"), "num_tokens": "i32", "stride_lt": "i32"}
    route_consts = {"NUM_EXPERTS": 128, "TOP_K": 8, "BLOCK_T": 16, "BLOCK_E": 128, "BLOCK_K": 8, "SOFTMAX_FIRST": True,
                    "RENORMALIZE": True}  # fmt: skip
    print("route (128 experts, top 8):", resources(moe_routing._route_kernel, route, route_consts, 4, 3))
    align = {"ids_ptr": _ptr("i64"), "sorted_pairs_ptr": _ptr("i32"), "tile_expert_ptr": _ptr("i32"), "num_pairs": "i32", "num_tiles": "i32"}
    align_consts = {"NUM_EXPERTS": 128, "BLOCK_E": 128, "BLOCK_M": 64, "CHUNK": 1024, "TILE_CHUNK": 16}
    print("align (128 experts):", resources(moe_routing._align_kernel, align, align_consts, 4, 3))
    gate_up = {"x_ptr": _ptr("bf16"), "w_ptr": _ptr("bf16"), "s_ptr": _ptr("bf16"), "b_ptr": _ptr("bf16"), "out_ptr": _ptr("bf16"),
               "sorted_pairs_ptr": _ptr("i32"), "tile_expert_ptr": _ptr("i32"), "num_pairs": "i32", "limit": "fp32",
               "alpha": "fp32", **STRIDES}  # fmt: skip
    down = {"x_ptr": _ptr("bf16"), "w_ptr": _ptr("bf16"), "s_ptr": _ptr("bf16"), "b_ptr": _ptr("bf16"), "out_ptr": _ptr("bf16"),
            "weights_ptr": _ptr("bf16"), "sorted_pairs_ptr": _ptr("i32"), "tile_expert_ptr": _ptr("i32"), "num_pairs": "i32",
            **STRIDES}  # fmt: skip
    print("expert GEMMs at Qwen3-30B-A3B's shape (hidden 2048, intermediate 768, bf16, contiguous weights):")
    for block_m, block_n, block_k, warps, stages in CONFIGS:
        tiles = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "PRECISION": "tf32", "MXFP4": False, "stride_wk": 1}
        up = resources(moe._gate_up_kernel, gate_up, {"N": 768, "K": 2048, "NUM_EXPERTS": 128, "TOP_K": 8, "CLAMPED": False,
                                                      **tiles}, warps, stages)  # fmt: skip
        dn = resources(moe._down_kernel, down, {"N": 2048, "K": 768, "NUM_EXPERTS": 128, "HAS_BIAS": False, **tiles}, warps, stages)
        print(f"  bm={block_m:<3} bn={block_n:<3} bk={block_k:<3} warps={warps} stages={stages}: gate_up {up} | down {dn}")


if __name__ == "__main__":
    main()
