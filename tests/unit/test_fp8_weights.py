"""FP8 weights, the parts: `quantization_config` parsing (each published layout, and the refusals),
the reference quantizer, the Triton kernels under the interpreter against the reference, the
scale loaders (per tensor / channel / block onto fused and tensor-parallel layers) and the flags.

Triton's interpreter rounds fp32 -> float8 wrongly just below powers of two (a rounded-up
mantissa does not carry into the exponent: 127.9 becomes 64, not 128). The quantize kernel on
CPU tensors therefore rounds in fp32 arithmetic first (kernels/fp8_gemm.py: `_round_to_e4m3`), so
its cast is exact, and the interpreted kernels are compared bit-for-bit: on values exactly
representable after scaling and on random ones. The GPU test compares the compiled cast."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import torch

from minisgl.distributed import TPInfo, get_tp_info, set_tp_info
from minisgl.engine.config import EngineConfig
from minisgl.engine.resolve import resolve_weights
from minisgl.kernels.fp8_ref import FP8_DTYPE, dequantize_fp8, fp8_linear_ref, quantize_fp8, quantize_weight_blocks
from minisgl.layers.fp8 import Fp8LinearFn, finish_linear, to_fp8_params
from minisgl.layers.linear import QKVParallelLinear, RowParallelLinear
from minisgl.models.quant_config import Fp8Scheme, parse_quant_config
from minisgl.platform.cpu import CpuPlatform
from minisgl.server.engine_args import add_engine_args, check_engine_args, engine_config
from tests.fp8_builders import FORMATS, quantization_config, quantize_blocks


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_published_layout_parses(fmt: str) -> None:
    scheme = parse_quant_config(quantization_config(fmt))  # type: ignore[arg-type]
    expected = {
        "ct-tensor": Fp8Scheme("compressed-tensors", "tensor", "token", ignore=("lm_head",)),
        "ct-channel": Fp8Scheme("compressed-tensors", "channel", "token", ignore=("lm_head",)),
        "ct-block": Fp8Scheme("compressed-tensors", "block", "group", (128, 128), ignore=("lm_head",)),
        "fp8-block": Fp8Scheme("fp8", "block", "group", (128, 128), "weight_scale_inv", ("lm_head",)),
    }[fmt]
    assert scheme == expected
    assert scheme.group == (128 if fmt.endswith("block") else None)


def test_unsupported_quantization_configs_are_refused() -> None:
    assert parse_quant_config(None) is None
    kv_only = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
               "kv_cache_scheme": {"num_bits": 8, "type": "float"}}  # fmt: skip
    assert parse_quant_config(kv_only) is None  # an FP8-KV checkpoint: float weights
    static = quantization_config("ct-channel")
    static["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    weight_only = quantization_config("ct-channel")
    weight_only["config_groups"]["group_0"]["input_activations"] = None
    int4 = quantization_config("ct-channel")
    int4["format"] = "pack-quantized"
    cases = [
        (static, "static input scales"),
        (weight_only, "weight-only"),
        (int4, "pack-quantized"),
        ({**quantization_config("fp8-block"), "activation_scheme": "static"}, "dynamic"),
        ({**quantization_config("fp8-block"), "weight_block_size": [128]}, "two positive"),
        ({"quant_method": "squeezellm", "bits": 4}, "quant_method 'squeezellm'"),
    ]
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            parse_quant_config(cfg)


def test_model_config_carries_the_scheme() -> None:
    from minisgl.models.config import ModelConfig

    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2}  # fmt: skip
    assert ModelConfig.from_dict(base).quantization is None
    cfg = ModelConfig.from_dict({**base, "quantization_config": quantization_config("fp8-block")})
    assert cfg.quantization is not None and cfg.quantization.block == (128, 128)


@pytest.mark.parametrize("group", [None, 32, 128])
def test_reference_quantizer_round_trips_within_float8_precision(group: int | None) -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 300) * torch.logspace(-3, 3, 7)[:, None]  # rows of very different magnitude
    x[2] = 0.0  # an all-zero row: zeros, not NaN
    q, scale = quantize_fp8(x, group)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert scale.shape == (7, 1 if group is None else -(-300 // group))
    back = dequantize_fp8(q, scale, group)
    assert torch.equal(back[2], torch.zeros(300))
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals, plus the subnormal step.
    step = scale.repeat_interleave(group or 300, dim=1)[:, :300] * 2.0**-9
    assert ((back - x).abs() <= x.abs() * 2.0**-4 + step).all()
    assert (q.float().abs().amax(dim=1)[[0, 1, 3]] == 448).all()  # each row's amax maps to 448


def test_block_quantizer_matches_the_checkpoint_writer() -> None:
    """kernels/fp8_ref.py's 128x128 blocks (experts quantized by minisgl) and the tests' own
    writer agree, partial edge blocks included."""
    torch.manual_seed(1)
    w = torch.randn(200, 300)
    q, scale = quantize_weight_blocks(w, (128, 128))
    q_writer, scale_writer = quantize_blocks(w, (128, 128))
    assert scale.shape == (2, 3)
    torch.testing.assert_close(scale, scale_writer, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_writer.view(torch.uint8))


def _interpreted() -> None:
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("triton was imported in compiled mode before the interpreter could be selected")


@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("shape", [(1, 40, 64), (17, 96, 300), (70, 33, 256)])
def test_triton_gemm_equals_reference_on_the_same_float8_inputs(group: int | None, shape: tuple[int, int, int]) -> None:
    _interpreted()
    from minisgl.kernels.fp8_gemm import fp8_gemm

    m, n, k = shape
    torch.manual_seed(m)
    x, w, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    if group is None:
        qw, ws = quantize_fp8(w)
    else:
        qw, blocks = quantize_weight_blocks(w, (128, group))
        ws = blocks.repeat_interleave(128, dim=0)[:n]
    xq, xs = quantize_fp8(x, group)
    out = fp8_gemm(xq, xs, qw, ws, group, torch.float32, bias)
    expected = dequantize_fp8(xq, xs, group) @ dequantize_fp8(qw, ws, group).t() + bias
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)  # fp32 summation order only


@pytest.mark.parametrize("group", [None, 128])
def test_triton_quantize_is_exact_on_representable_values(group: int | None) -> None:
    """Each row (group) holds float8 values times a power of two, one of them +-448, so
    scale = 2^e and x / scale is a float8 value: the kernel must give the reference's bits."""
    _interpreted()
    from minisgl.kernels.fp8_gemm import fp8_quantize

    torch.manual_seed(2)
    m, k = 5, 300
    values = torch.randn(m, k).clamp(-400, 400).to(FP8_DTYPE).float()
    span = group or k
    values[:, ::span] = 448.0
    x = values * (2.0 ** torch.arange(-4, 1))[:, None]
    q, scale = fp8_quantize(x, group)
    q_ref, scale_ref = quantize_fp8(x, group)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("group", [None, 128])
def test_triton_quantize_equals_reference_on_random_values(group: int | None) -> None:
    """Random magnitudes (subnormals and values just below powers of two included): on CPU the
    kernel rounds to e4m3 in fp32 before its cast (`_round_to_e4m3`), which leaves the
    interpreter's cast nothing to round, so its bits equal torch's cast of the reference."""
    _interpreted()
    from minisgl.kernels.fp8_gemm import fp8_quantize

    torch.manual_seed(3)
    x = torch.randn(9, 260) * torch.logspace(-4, 2, 260)
    x[0, :8] = torch.tensor([447.9, -448.0, 127.9, 0.0, 1e-30, -3.5e-3, 31.99, 2.0**-9])
    q, scale = fp8_quantize(x, group)
    q_ref, scale_ref = quantize_fp8(x, group)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert (q_ref.float().abs() < 2.0**-6).any()  # some subnormals were produced


def test_linear_fn_impls_agree_and_hold_the_weight() -> None:
    _interpreted()
    torch.manual_seed(4)
    w = torch.randn(48, 200)
    qw, ws = quantize_fp8(w)
    fn = Fp8LinearFn(qw, ws, None, "torch")
    x = torch.randn(3, 5, 200)
    out = fn(x, torch.empty(0))
    assert out.shape == (3, 5, 48)
    torch.testing.assert_close(out, fp8_linear_ref(x, qw, ws, None))
    torch.testing.assert_close(fn.with_impl("triton")(x), out, rtol=1e-5, atol=1e-5)  # fp32 summation order
    torch.testing.assert_close(fn.dequantized(), w, rtol=2**-4, atol=1e-3)


def _qkv_checkpoint(layout: str) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Per part (q, k, v) of a 2-q-head / 2-kv-head qkv: its float8 weight and scale as a checkpoint
    stores them, and the float weight they stand for."""
    torch.manual_seed(5)
    parts, dense = {}, {}
    for part, rows in (("q", 64), ("k", 64), ("v", 64)):
        w = torch.randn(rows, 160)
        if layout == "tensor":
            scale = (w.abs().max() / 448).reshape(1)
            q = (w / scale).clamp(-448, 448).to(FP8_DTYPE)
            full = q.float() * scale
        elif layout == "channel":
            scale = w.abs().amax(1, keepdim=True) / 448
            q = (w / scale).to(FP8_DTYPE)
            full = q.float() * scale
        else:
            q, scale = quantize_blocks(w, (32, 32))
            full = q.float() * scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
        parts[part], dense[part] = {"weight": q, "weight_scale": scale}, full
    return parts, dense


@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_scale_loaders_shard_like_the_weights(layout: str, tp_size: int) -> None:
    """A fused qkv and a row-parallel layer in float8, loaded on each rank: every rank's
    dequantized weight is its slice of the checkpoint's dequantized one."""
    parts, dense = _qkv_checkpoint(layout)
    block = (32, 32) if layout == "block" else None
    saved = get_tp_info()
    try:
        for rank in range(tp_size):
            set_tp_info(TPInfo(rank, tp_size))
            qkv = QKVParallelLinear(160, 32, 2, 2, bias=False)
            to_fp8_params(qkv, layout, block, "weight_scale")  # type: ignore[arg-type]
            for part, tensors in parts.items():
                for name, tensor in tensors.items():
                    param = getattr(qkv, name)
                    param.weight_loader(param, tensor, part)
            finish_linear(qkv, "weight_scale", 32 if block else None, "torch")
            got = qkv._linear.dequantized()  # type: ignore[attr-defined]
            rows = 64 // tp_size
            expected = torch.cat([dense[p][rank * rows : (rank + 1) * rows] for p in "qkv"])
            torch.testing.assert_close(got, expected, rtol=0, atol=0)

            down = RowParallelLinear(64 * tp_size, 48)
            to_fp8_params(down, layout, block, "weight_scale")  # type: ignore[arg-type]
            w = torch.randn(48, 64 * tp_size, generator=torch.Generator().manual_seed(6))
            if layout == "block":
                q, scale = quantize_blocks(w, (32, 32))
                full = q.float() * scale.repeat_interleave(32, 0)[:48].repeat_interleave(32, 1)
            else:
                scale = w.abs().amax(1, keepdim=True) / 448 if layout == "channel" else (w.abs().max() / 448).reshape(1)
                q = (w / scale).to(FP8_DTYPE)
                full = q.float() * scale
            down.weight.weight_loader(down.weight, q)  # type: ignore[attr-defined]
            down.weight_scale.weight_loader(down.weight_scale, scale)  # type: ignore[attr-defined]
            finish_linear(down, "weight_scale", 32 if block else None, "torch")
            torch.testing.assert_close(down._linear.dequantized(), full[:, rank * 64 : (rank + 1) * 64], rtol=0, atol=0)  # type: ignore[attr-defined]
            assert down.weight_held_by_fn and down.weight.numel() == 0
    finally:
        set_tp_info(saved)


def test_block_scales_that_straddle_ranks_are_refused() -> None:
    saved = get_tp_info()
    try:
        set_tp_info(TPInfo(0, 2))
        down = RowParallelLinear(96, 16)  # 48 columns a rank, blocks of 32
        with pytest.raises(ValueError, match="straddle"):
            to_fp8_params(down, "block", (32, 32), "weight_scale")
    finally:
        set_tp_info(saved)


def test_quantization_flag_reaches_the_config_and_gguf_is_refused() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--quantization", "fp8", "--device", "cpu"])
    assert engine_config(args).quantization == "fp8"
    assert parser.parse_args([]).quantization == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])
    assert "--weights gguf" in (check_engine_args(parser.parse_args(["--quantization", "fp8", "--weights", "gguf"])) or "")
    with pytest.raises(ValueError, match="unknown quantization"):
        EngineConfig(quantization="int3")  # type: ignore[arg-type]
    platform = CpuPlatform()
    # The embedded GGUF on CPU: fp8 dequantizes the blocks first (float weights to quantize).
    assert resolve_weights(EngineConfig(quantization="fp8"), platform)[0] != "gguf"
    assert resolve_weights(EngineConfig(), platform)[0] == "gguf"
    with pytest.raises(ValueError, match="--quantization fp8"):
        resolve_weights(replace(EngineConfig(quantization="fp8"), weights="gguf"), platform)
