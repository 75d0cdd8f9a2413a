"""GPT-OSS's experts: the fused Triton kernel (biases, clamped SwiGLU) vs the torch reference, the
reference vs transformers' GptOssMLP, and the layer's tensor-parallel slices and loaders.

Without CUDA the kernel runs in Triton's interpreter on small shapes (fp32 and fp16: the
interpreter mis-rounds bf16); the `gpu` tests run GPT-OSS-20B's expert shape in bf16.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from minisgl.distributed import TPInfo, get_tp_info, set_tp_info  # noqa: E402
from minisgl.kernels.mxfp4 import dequantize_mxfp4  # noqa: E402
from minisgl.kernels.moe import _gate_up_kernel  # noqa: E402
from minisgl.kernels.swiglu_moe import Mxfp4Weights, swiglu_moe  # noqa: E402
from minisgl.kernels.swiglu_moe_ref import swiglu_moe_ref  # noqa: E402
from minisgl.layers.moe_swiglu import BiasedTopKRouter, GptOssMoeBlock, SwigluExperts  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    not CUDA and type(_gate_up_kernel).__name__ != "InterpretedFunction",
    reason="triton was imported in compiled mode before this module could select the interpreter",
)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0
          ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Scaled so gate and up often pass the clamp (limit 1.5 here) on both sides."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 1.5 / hidden**0.5
    b13 = torch.randn(experts, 2 * inter, generator=gen) * 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    b2 = torch.randn(experts, hidden, generator=gen) * 0.5
    router = BiasedTopKRouter(experts, hidden, top_k)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=gen))
        router.bias.copy_(torch.randn(experts, generator=gen))
        weights, ids = router(x)
    return tuple(t.to(DEVICE, dtype) if t.is_floating_point() else t.to(DEVICE) for t in (x, w13, b13, w2, b2, weights, ids))


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (7, 6, 2), (40, 8, 4), (33, 3, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("down_bias", [True, False])
def test_kernel_matches_ref(tokens: int, experts: int, top_k: int, dtype: torch.dtype, down_bias: bool) -> None:
    x, w13, b13, w2, b2, weights, ids = _case(tokens, experts, top_k, 32, 48, dtype, seed=tokens)
    bias = b2 if down_bias else None
    out = swiglu_moe(x, w13, b13, w2, bias, weights, ids, 1.5, 1.702)
    ref = swiglu_moe_ref(x.float(), w13.float(), b13.float(), w2.float(), None if bias is None else bias.float(),
                         weights.float(), ids, 1.5, 1.702)  # fmt: skip
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.cpu(), atol=atol, rtol=rtol)


def _mxfp4(experts: int, rows: int, cols: int, seed: int) -> tuple[Mxfp4Weights, torch.Tensor]:
    """Random codes and scales (values up to ~0.4) as the kernel takes them, and the dense fp32
    weights [E, rows, cols] they stand for."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 125, (experts, rows, cols // 32), dtype=torch.uint8, generator=gen)
    dense = dequantize_mxfp4(blocks, scales, torch.float32)
    return Mxfp4Weights(blocks.flatten(-2).to(DEVICE), scales.to(DEVICE)), dense.to(DEVICE)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (19, 6, 2), (40, 8, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mxfp4_kernel_matches_ref_on_dequantized(tokens: int, experts: int, top_k: int, dtype: torch.dtype) -> None:
    """Weights kept as MXFP4 codes and scales, dequantized in the kernel's registers: equal to the
    reference on the dense weights they stand for (hidden 96 and intermediate 64: several 32-input
    scale groups, a K tail in the 64-wide K tiles)."""
    hidden, inter = 96, 64
    x, _, b13, _, b2, weights, ids = _case(tokens, experts, top_k, hidden, inter, dtype, seed=tokens)
    w13, w13_dense = _mxfp4(experts, 2 * inter, hidden, seed=1)
    w2, w2_dense = _mxfp4(experts, hidden, inter, seed=2)
    out = swiglu_moe(x, w13, b13, w2, b2, weights, ids, 1.5, 1.702)
    ref = swiglu_moe_ref(x.float(), w13_dense, b13.float(), w2_dense, b2.float(), weights.float(), ids, 1.5, 1.702)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.cpu(), atol=atol, rtol=rtol)


def _hf_mlp(hidden: int, inter: int, experts: int, top_k: int, limit: float) -> Any:
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = tf.GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                             num_experts_per_tok=top_k, swiglu_limit=limit)  # fmt: skip
    torch.manual_seed(0)
    mlp = GptOssMLP(config).eval()
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(0.0, 0.3)
    return mlp


def _load_block(block: GptOssMoeBlock, mlp: Any) -> None:
    for name, tensor in mlp.state_dict().items():
        param = block.get_parameter(name)
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            param.data.copy_(tensor)
        else:
            loader(param, tensor)


def test_block_matches_transformers_gpt_oss_mlp() -> None:
    """Router (bias, softmax over the top k) and experts (interleaved gate/up in HF's [E, in, out]
    layout, biases, clamp) loaded from transformers' module equal its forward."""
    mlp = _hf_mlp(32, 24, 5, 2, 1.2)
    block = GptOssMoeBlock(5, 2, 32, 24, 1.2, 1.702, impl="torch")
    _load_block(block, mlp)
    x = torch.randn(11, 32)
    with torch.no_grad():
        expected, _ = mlp(x[None])
        got = block(x)
    torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=1e-5)


@pytest.fixture
def restore_tp() -> Any:
    saved = get_tp_info()
    yield
    set_tp_info(saved)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_slices_sum_to_full(restore_tp: None, tp_size: int) -> None:
    """Each rank's slice of the intermediate dimension (and rank 0's down bias): the partial outputs
    the all-reduce sums add up to the unsharded block's."""
    mlp = _hf_mlp(32, 24, 4, 2, 1.2)
    x = torch.randn(9, 32)
    set_tp_info(TPInfo(0, 1))
    full = GptOssMoeBlock(4, 2, 32, 24, 1.2, 1.702, impl="torch")
    _load_block(full, mlp)
    with torch.no_grad():
        expected = full(x)
        partials = []
        for rank in range(tp_size):
            set_tp_info(TPInfo(rank, tp_size))
            shard = GptOssMoeBlock(4, 2, 32, 24, 1.2, 1.702, impl="torch")
            _load_block(shard, mlp)
            assert shard.experts.gate_up_proj.shape == (4, 2 * 24 // tp_size, 32)
            experts = shard.experts
            bias = experts.down_proj_bias if rank == 0 else None
            partials.append(experts._fn(x, experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, bias,
                                        *shard.router(x), 1.2, 1.702))  # fmt: skip
    torch.testing.assert_close(torch.stack(partials).sum(0), expected, atol=1e-5, rtol=1e-5)


def _mxfp4_checkpoint(experts: int, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    """Expert tensors as a GPT-OSS checkpoint ships them (transformers' names and layouts)."""
    gen = torch.Generator().manual_seed(3)
    ckpt: dict[str, torch.Tensor] = {}
    for proj, (rows, cols) in {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}.items():
        ckpt[f"{proj}_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=gen)
        ckpt[f"{proj}_scales"] = torch.randint(120, 125, (experts, rows, cols // 32), dtype=torch.uint8, generator=gen)
        ckpt[f"{proj}_bias"] = torch.randn(experts, rows, generator=gen) * 0.3
    return ckpt


def _experts_from(ckpt: dict[str, torch.Tensor], resident: bool) -> SwigluExperts:
    """The layer loaded as the model loader would: 4-bit under the checkpoint's names, or
    dequantized through the dense parameters' `blocks` / `scales` parts."""
    experts = SwigluExperts(4, 64, 64, 1.5, 1.702, impl="triton" if resident else "torch", mxfp4=True)
    assert experts.mxfp4 == resident
    for name, tensor in ckpt.items():
        if not resident and name.endswith(("_blocks", "_scales")):
            proj, part = name.rsplit("_", 1)
            param = experts.get_parameter(proj)
            param.weight_loader(param, tensor, part)  # type: ignore[attr-defined]
        else:
            param = experts.get_parameter(name)
            param.weight_loader(param, tensor)  # type: ignore[attr-defined]
    return experts


@pytest.mark.parametrize("tp_size", [1, 2])
def test_resident_mxfp4_layer_equals_dequantized(restore_tp: None, tp_size: int) -> None:
    """Experts kept 4-bit (the fused kernel) equal the same checkpoint dequantized at load (the
    reference), each TP rank on its slice: gate_up rows de-interleaved, down's inputs cut by whole
    scale groups, rank 0 adding the down bias."""
    ckpt = _mxfp4_checkpoint(4, 64, 64)
    x = torch.randn(13, 64)
    router = BiasedTopKRouter(4, 64, 2)
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0)
        router.bias.normal_(0.0, 1.0)
        routing = router(x)
    outs = {}
    for resident in (True, False):
        partials = []
        for rank in range(tp_size):
            set_tp_info(TPInfo(rank, tp_size))
            experts = _experts_from(ckpt, resident)
            if resident:
                assert experts.gate_up_proj_blocks.shape == (4, 2 * 64 // tp_size, 32)
                assert experts.down_proj_scales.shape == (4, 64, 2 // tp_size)
            with torch.no_grad():
                partials.append(experts.partial(x, routing))
        outs[resident] = torch.stack(partials).sum(0)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=1e-5)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_kernel_gpt_oss_20b_shape_bf16_gpu(tokens: int) -> None:
    """In bf16 both the kernel and the reference sit ~2^-8 of the output's scale from the exact
    result (the 2880-input down projection of an activation rounded to bf16), whatever an element's
    own size: the 0.03 + 3% rule fails on small outputs of either (the bf16 reference itself misses
    it on 1 of the 16-token case's 46,080 elements, by 0.037, on CPU). So both are measured against
    fp32 math on the same bf16 inputs: the kernel within 3e-2 of the output's scale, and its error
    (largest and mean) within twice the bf16 reference's own."""
    x, w13, b13, w2, b2, weights, ids = _case(tokens, 32, 4, 2880, 2880, torch.bfloat16, seed=tokens)
    out = swiglu_moe(x, w13, b13, w2, b2, weights, ids, 7.0, 1.702).float()
    ref = swiglu_moe_ref(x, w13, b13, w2, b2, weights, ids, 7.0, 1.702).float()
    exact = swiglu_moe_ref(*(t.float() for t in (x, w13, b13, w2, b2, weights)), ids, 7.0, 1.702)
    out_err, ref_err = (out - exact).abs(), (ref - exact).abs()
    scale = exact.abs().max().item()
    assert out_err.max().item() <= 3e-2 * scale, (out_err.max().item(), scale)
    assert out_err.max().item() <= 2 * ref_err.max().item() + 1e-3, (out_err.max().item(), ref_err.max().item())
    assert out_err.mean().item() <= 2 * ref_err.mean().item() + 1e-4, (out_err.mean().item(), ref_err.mean().item())
