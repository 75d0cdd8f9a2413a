"""4-bit checkpoints (W4A16): `quantization_config` parsing, each format's published packing read
back exactly (hand-built words; compressed-tensors' own decompressor), and the torch reference."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import (
    PackedQuantizationCompressor,
)
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from minisgl.kernels.w4_ref import (
    W4Weight,
    concat_outputs,
    dequantize,
    pack_rows,
    unpack_rows,
    w4_linear_ref,
)
from minisgl.models.quant_config_w4 import W4Scheme, parse_w4_scheme
from minisgl.models.w4_formats import AWQ_ORDER, to_w4, unpack_columns
from tests.w4_builders import (
    awq_tensors,
    ct_tensors,
    format_tensors,
    gptq_tensors,
    quantization_config,
    rtn,
)


def _scheme(fmt: str, group: int = 32, sym: bool = True, desc_act: bool = False) -> W4Scheme:
    scheme = parse_w4_scheme({"quantization_config": quantization_config(fmt, group, sym, desc_act)})
    assert scheme is not None
    return scheme


def test_parse_each_format() -> None:
    assert _scheme("gptq", 128, sym=False, desc_act=True) == W4Scheme("gptq", 128, sym=False, desc_act=True, zero_offset=1)
    assert _scheme("awq", 128) == W4Scheme("awq", 128, sym=False)
    ct = _scheme("compressed-tensors", 64, sym=False)
    assert (ct.format, ct.group_size, ct.sym, ct.ignore) == ("compressed-tensors", 64, False, ("lm_head",))
    v2 = parse_w4_scheme({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1,
                                                  "checkpoint_format": "gptq_v2"}})  # fmt: skip
    assert v2 == W4Scheme("gptq", None, sym=True, zero_offset=0)


def test_parse_not_4bit_is_none() -> None:
    assert parse_w4_scheme({}) is None
    fp8 = {"quant_method": "compressed-tensors", "format": "float-quantized",
           "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}, "format": "float-quantized"}}}  # fmt: skip
    assert parse_w4_scheme({"quantization_config": fp8}) is None
    assert parse_w4_scheme({"quantization_config": {"quant_method": "fp8"}}) is None


@pytest.mark.parametrize(
    "config, message",
    [
        ({"quant_method": "gptq", "bits": 8}, "8-bit"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "GEMM packing"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero points"),
    ],
)
def test_parse_refuses_unsupported(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_w4_scheme({"quantization_config": config})


@pytest.mark.parametrize("change, message", [
    ({"actorder": "group"}, "actorder"), ({"num_bits": 8}, "int4 only"), ({"strategy": "tensor"}, "strategy"),
])  # fmt: skip
def test_parse_refuses_unsupported_pack_quantized(change: dict, message: str) -> None:
    config = quantization_config("compressed-tensors", 128, True)
    config["config_groups"]["group_0"]["weights"].update(change)
    with pytest.raises(ValueError, match=message):
        parse_w4_scheme({"quantization_config": config})
    config = quantization_config("compressed-tensors", 128, True)
    config["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    with pytest.raises(ValueError, match="W4A16"):
        parse_w4_scheme({"quantization_config": config})


def test_layout_facts_by_hand() -> None:
    """Words written from the published descriptions, not by the test builders."""
    # GPTQ qweight: input 8r + j in bits 4j; values 0..7 down one column -> 0x76543210.
    values = torch.arange(8, dtype=torch.int32).view(8, 1)
    assert pack_rows(values).item() == 0x76543210
    assert unpack_rows(torch.tensor([[0x76543210]], dtype=torch.int32), 8).flatten().tolist() == list(range(8))
    # AWQ: nibble i holds output AWQ_ORDER[i]; outputs 0..7 holding 0..7 -> nibbles 0 2 4 6 1 3 5 7.
    word = sum(v << (4 * i) for i, v in enumerate(AWQ_ORDER))
    assert word == 0x75316420
    packed = torch.tensor([[word - 2**32 if word >= 2**31 else word]], dtype=torch.int32)
    assert unpack_columns(packed, 8, AWQ_ORDER).flatten().tolist() == list(range(8))
    # GPTQ v1 symmetric zero points: 8 stored as 7 -> 0x77777777 (a stored 15 reads 16).
    tensors = {"qweight": torch.zeros(4, 8, dtype=torch.int32), "scales": torch.ones(1, 8, dtype=torch.float16),
               "qzeros": torch.tensor([[0x77777777]], dtype=torch.int32)}  # fmt: skip
    assert to_w4(_scheme("gptq", 32), tensors, "layer").zeros.flatten().tolist() == [8] * 8
    tensors["qzeros"] = torch.tensor([[-1]], dtype=torch.int32)  # every nibble 0xF
    assert to_w4(_scheme("gptq", 32), tensors, "layer").zeros.flatten().tolist() == [16] * 8


@pytest.mark.parametrize("fmt, sym, desc_act", [
    ("gptq", True, False), ("gptq", False, False), ("gptq", True, True), ("gptq", False, True),
    ("awq", False, False), ("compressed-tensors", True, False), ("compressed-tensors", False, False),
])  # fmt: skip
def test_round_trip_each_format(fmt: str, sym: bool, desc_act: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 96, generator=gen)
    perm = torch.randperm(96, generator=gen) if desc_act else None
    qz = rtn(w, 32, sym, perm, torch.float32 if fmt == "compressed-tensors" else torch.float16)
    tensors = format_tensors(fmt, qz, sym)
    weight = to_w4(_scheme(fmt, 32, sym, desc_act), tensors, "layer")
    assert (weight.in_features, weight.out_features) == (96, 40)
    assert (weight.g_idx is not None) == desc_act  # a trivial g_idx is dropped
    assert torch.equal(dequantize(weight), qz.dequantize())
    step = qz.scales[:, qz.g_idx.long()]
    assert ((dequantize(weight) - w).abs() <= step * 0.5 + 1e-6).float().mean() > 0.99  # rounding, a few clamped
    x = torch.randn(3, 96, generator=gen)
    torch.testing.assert_close(w4_linear_ref(x, weight), x @ qz.dequantize().T)


@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_matches_its_own_decompressor(sym: bool) -> None:
    qz = rtn(torch.randn(24, 196), 28, sym, None, torch.float32)  # 196 inputs: a partial last word
    tensors = ct_tensors(qz, sym)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=sym,
                                                                             strategy="group", group_size=28))  # fmt: skip
    theirs = PackedQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]
    ours = dequantize(to_w4(_scheme("compressed-tensors", 28, sym), tensors, "layer"))
    assert torch.equal(ours, theirs)


def test_bad_checkpoint_tensors_are_clear_errors() -> None:
    qz = rtn(torch.randn(16, 64), 32, True)
    tensors = gptq_tensors(qz)
    with pytest.raises(ValueError, match="lacks qzeros"):
        to_w4(_scheme("gptq"), {k: v for k, v in tensors.items() if k != "qzeros"}, "layer")
    with pytest.raises(ValueError, match="scales"):
        to_w4(_scheme("gptq", 16), tensors, "layer")  # group 16 needs 4 groups of scales
    with pytest.raises(ValueError, match="int32"):
        to_w4(_scheme("gptq"), {**tensors, "qweight": tensors["qweight"].float()}, "layer")
    with pytest.raises(ValueError, match="desc_act checkpoint without g_idx"):
        to_w4(_scheme("gptq", 32, True, True), {k: v for k, v in tensors.items() if k != "g_idx"}, "layer")
    with pytest.raises(ValueError, match="multiple of the group size"):
        to_w4(_scheme("awq", 48), awq_tensors(rtn(torch.randn(16, 64), 32, False)), "layer")
    with pytest.raises(ValueError, match="multiple of the group size"):
        to_w4(_scheme("compressed-tensors", 48), ct_tensors(rtn(torch.randn(16, 64), 32, True), True), "layer")


def test_concat_outputs_joins_equal_groups_only() -> None:
    def part(n: int, g_idx: torch.Tensor | None) -> W4Weight:
        q = torch.randint(0, 16, (64, n))
        return W4Weight(pack_rows(q), torch.rand(2, n), torch.full((2, n), 8, dtype=torch.uint8), g_idx, 32, 64)

    plain = concat_outputs([part(16, None), part(8, None), part(8, None)])
    assert [p.out_features for p in plain] == [32]
    perm = torch.randperm(64)
    g_a = (torch.arange(64)[perm] // 32).to(torch.int32)
    mixed = concat_outputs([part(16, g_a), part(8, g_a.clone()), part(8, (torch.arange(64) // 32).to(torch.int32))])
    assert [p.out_features for p in mixed] == [24, 8]
    parts = [part(16, None), part(8, None)]
    joined = concat_outputs(parts)[0]
    x = torch.randn(2, 64)
    torch.testing.assert_close(w4_linear_ref(x, joined), torch.cat([w4_linear_ref(x, p) for p in parts], dim=-1))


def test_collector_only_for_4bit_checkpoints_at_one_rank(tmp_path) -> None:
    import json

    from minisgl.distributed import TPInfo, get_tp_info, set_tp_info
    from minisgl.models.w4_weights import W4Collector

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert W4Collector.for_checkpoint(torch.nn.Linear(2, 2), tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization_config("gptq", 128, True)}))
    assert W4Collector.for_checkpoint(torch.nn.Linear(2, 2), tmp_path) is not None
    before = get_tp_info()
    set_tp_info(TPInfo(0, 2))
    try:
        with pytest.raises(ValueError, match="one rank"):
            W4Collector.for_checkpoint(torch.nn.Linear(2, 2), tmp_path)
    finally:
        set_tp_info(before)
