"""What one MoE layer forward launches (issue 28): the torch ops and Triton kernels of
`layers/moe.py`'s SparseMoeBlock (router + fused experts, impl='triton') for one prefill chunk.

On CPU the Triton kernels run in the interpreter and the torch ops are counted at the aten
dispatch level (TorchDispatchMode): the same ops launch on CUDA, where most are one kernel each
(sort and topk may launch a few). Triton launches are counted through a profile hook on the
interpreter's `run`, and aten ops the interpreter makes inside a launch are not counted. On CUDA
the tool counts the kernels the torch profiler sees instead (`--cuda`).

Findings: docs/performance.md, "Profiles of the large shapes" (the counts before and after the
fused routing and align kernels).

    python tools/bench_moe_launches.py [--tokens 512] [--experts 128] [--top-k 8] [--cuda]
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    from minisgl.kernels.interpret import use_triton_interpreter

    use_triton_interpreter()

from minisgl.layers.moe import SparseMoeBlock  # noqa: E402

# Ops that never launch a kernel (metadata, views, allocation without a fill).
_FREE = {
    "empty.memory_format", "empty_strided.default", "view.default", "_unsafe_view.default", "reshape.default",
    "select.int", "slice.Tensor", "t.default", "transpose.int", "detach.default", "alias.default",
    "unsqueeze.default", "squeeze.dim", "expand.default", "as_strided.default", "split.Tensor", "unbind.int",
    "chunk.default", "permute.default", "_reshape_alias.default", "lift_fresh.default",
}  # fmt: skip


class _AtenCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.inside_triton = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = f"{func.overloadpacket.__name__}.{func._overloadname}"
        if not self.inside_triton and name not in _FREE:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _count_cpu(block: SparseMoeBlock, x: torch.Tensor) -> tuple[collections.Counter[str], collections.Counter[str]]:
    from triton.runtime.interpreter import InterpretedFunction

    run_code = InterpretedFunction.run.__code__
    counter = _AtenCounter()
    kernels: collections.Counter[str] = collections.Counter()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if frame.f_code is run_code:
            if event == "call":
                kernels[frame.f_locals["self"].fn.__name__] += 1
                counter.inside_triton += 1
            elif event == "return":
                counter.inside_triton -= 1

    with torch.no_grad(), counter:
        sys.setprofile(hook)
        try:
            block(x)
        finally:
            sys.setprofile(None)
    return counter.ops, kernels


def _count_cuda(block: SparseMoeBlock, x: torch.Tensor) -> collections.Counter[str]:
    with torch.no_grad():
        block(x)  # compile first
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            block(x)
            torch.cuda.synchronize()
    kernels: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:60]] += 1
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64, help="launch counts do not depend on it; small is fast")
    parser.add_argument("--inter", type=int, default=32)
    parser.add_argument("--cuda", action="store_true", help="count CUDA kernels with the torch profiler")
    args = parser.parse_args()
    device = torch.device("cuda" if args.cuda else "cpu")
    dtype = torch.bfloat16 if args.cuda else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        block = SparseMoeBlock(args.experts, args.top_k, args.hidden, args.inter, norm_topk_prob=True, impl="triton")
    for param in block.parameters():
        param.data = (torch.randn_like(param) * 0.1).to(dtype)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    print(f"one SparseMoeBlock forward: {args.tokens} tokens, {args.experts} experts, top {args.top_k}")
    if args.cuda:
        kernels = _count_cuda(block, x)
        for name, count in kernels.most_common():
            print(f"  {count:4d}  {name}")
        print(f"CUDA kernels: {sum(kernels.values())}")
        return
    ops, triton_kernels = _count_cpu(block, x)
    for name, count in ops.most_common():
        print(f"  {count:4d}  aten.{name}")
    for name, count in triton_kernels.most_common():
        print(f"  {count:4d}  triton {name}")
    print(f"aten ops that launch: {sum(ops.values())}, Triton kernels: {sum(triton_kernels.values())}, "
          f"total: {sum(ops.values()) + sum(triton_kernels.values())}")  # fmt: skip


if __name__ == "__main__":
    main()
