"""`--weights` and `--cpu-isa`: resolved once by `resolve(config, platform)` (gguf by default for a
.gguf model on CPU, fp32 / bf16 dequantized otherwise), refused with the fix named where they
cannot run, and routed from the command line and the `LLM(...)` keywords."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minisgl.engine.config import EngineConfig
from minisgl.engine.resolve import resolve
from minisgl.llm.llm import split_config
from minisgl.platform.cpu import CpuPlatform
from minisgl.platform.kernel_config import KernelConfig
from minisgl.server import args
from tests.unit.test_resolve import _PretendGpu

GGUF = "/models/m.Q4_1.gguf"
HF_DIR = "/models/hf-dir"


def _cpu(native_bf16: bool) -> CpuPlatform:
    cpu = CpuPlatform()
    cpu.default_dtype = torch.bfloat16 if native_bf16 else torch.float32
    return cpu


@pytest.mark.parametrize("native_bf16", [False, True])
def test_auto_weights(native_bf16: bool) -> None:
    cpu, native = _cpu(native_bf16), "bfloat16" if native_bf16 else "float32"

    def picked(**kwargs: object) -> tuple[str, str]:
        resolved = resolve(EngineConfig(device="cpu", **kwargs), cpu)  # type: ignore[arg-type]
        return resolved.weights, resolved.dtype

    # A GGUF (the embedded default is one) on CPU keeps its blocks, with fp32 activations.
    assert picked() == picked(model=GGUF) == ("gguf", "float32")
    # An explicit dtype is the dequantized model in that dtype, as before (float32: exact vs HF).
    assert picked(model=GGUF, dtype="float32") == ("float32", "float32")
    assert picked(model=GGUF, dtype="bfloat16") == ("bfloat16", "bfloat16")
    # No blocks to keep: a Hugging Face checkpoint, dummy weights, several ranks.
    assert picked(model=HF_DIR) == picked(dummy_weights=True) == (native, native)
    assert picked(model=GGUF, tp_size=2) == (native, native)
    # Named explicitly.
    assert picked(weights="gguf", dtype="float32") == ("gguf", "float32")
    assert picked(weights="float32") == ("float32", "float32")
    assert picked(weights="bfloat16", model=HF_DIR) == ("bfloat16", "bfloat16")
    resolved = resolve(EngineConfig(device="cpu"), cpu)
    assert resolve(resolved, cpu) == resolved  # resolving twice changes nothing


def test_quantized_weights_take_the_fp32_decode_attention_kernel() -> None:
    """GGUF blocks kept quantized are not the exact mode: their fp32 activations get the C++ norms,
    rotary, SiLU and decode attention; a dequantized fp32 model keeps the references unless asked."""
    from dataclasses import replace

    from minisgl.platform.kernel_config import KernelConfig

    cpu = _cpu(False)
    assert resolve(EngineConfig(device="cpu", model=GGUF), cpu).kernels.cpu_kernels_fp32 is True
    assert resolve(EngineConfig(device="cpu", model=GGUF, weights="float32"), cpu).kernels.cpu_kernels_fp32 is False
    asked = EngineConfig(device="cpu", model=HF_DIR, weights="float32", kernels=KernelConfig(cpu_kernels_fp32=True))
    assert resolve(asked, cpu).kernels.cpu_kernels_fp32 is True
    told = EngineConfig(device="cpu", model=GGUF, kernels=KernelConfig(cpu_kernels_fp32=False))
    assert resolve(told, cpu).kernels.cpu_kernels_fp32 is False
    # The switch covers the norms/rotary/SiLU kernels and the decode attention: either one on keeps it.
    no_attn = replace(asked, model=GGUF, weights="gguf", kernels=KernelConfig(cpu_attn_kernel=False))
    assert resolve(no_attn, cpu).kernels.cpu_kernels_fp32 is True
    off = replace(no_attn, kernels=KernelConfig(cpu_attn_kernel=False, cpu_kernels=False))
    assert resolve(off, cpu).kernels.cpu_kernels_fp32 is False  # no kernel at all
    assert resolve(EngineConfig(model=GGUF), _PretendGpu()).kernels.cpu_kernels_fp32 is False


def test_gpu_default_is_dequantized() -> None:
    resolved = resolve(EngineConfig(model=GGUF), _PretendGpu())
    assert (resolved.weights, resolved.dtype) == ("bfloat16", "bfloat16")


@pytest.mark.parametrize("config, message", [
    (EngineConfig(model=GGUF, weights="gguf", tp_size=2), "one rank: for --tp 2 pass --weights float32"),
    (EngineConfig(model=HF_DIR, weights="gguf"), "needs a .gguf model"),
    (EngineConfig(model=GGUF, weights="gguf", dtype="bfloat16"), "computes in float32: drop --dtype bfloat16"),
    (EngineConfig(model=GGUF, weights="gguf", dummy_weights=True), "--dummy-weights has none"),
    (EngineConfig(model=GGUF, weights="float32", dtype="bfloat16"), "--weights float32 and --dtype bfloat16 disagree"),
])  # fmt: skip
def test_impossible_weights_are_clear_errors(config: EngineConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve(config, _cpu(False))


def test_gguf_weights_on_a_gpu_are_refused() -> None:
    with pytest.raises(ValueError, match="quantized CPU kernels only: on a GPU pass --weights bfloat16"):
        resolve(EngineConfig(model=GGUF, weights="gguf"), _PretendGpu())


def test_unknown_values_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown weights 'int4'"):
        EngineConfig(weights="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown cpu_isa 'sse2'"):
        KernelConfig(cpu_isa="sse2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown cpu_isa"):
        split_config(None, {"cpu_isa": "neon"})


def test_cpu_isa_choice() -> None:
    """Not a switch: resolve keeps it on every platform; the kernels check it against the CPU."""
    for isa in ("auto", "avx512", "avx2", "portable"):
        config = EngineConfig(kernels=KernelConfig(cpu_isa=isa))  # type: ignore[arg-type]
        assert resolve(config, _cpu(False)).kernels.cpu_isa == isa
        assert resolve(config, _PretendGpu()).kernels.cpu_isa == isa


def test_flags_reach_the_fields(capsys: pytest.CaptureFixture[str]) -> None:
    defaults = args.parse_args([])
    assert defaults.engine.weights == "auto" and defaults.engine.kernels.cpu_isa == "auto"
    config = args.parse_args(["--weights", "gguf", "--cpu-isa", "avx2"])
    assert config.engine.weights == "gguf" and config.engine.kernels == replace(KernelConfig(), cpu_isa="avx2")
    assert args.parse_args(["--weights", "bfloat16"]).engine.weights == "bfloat16"
    for argv, message in ((["--weights", "gguf", "--tp", "2"], "--weights gguf runs at one rank"),
                          (["--weights", "gguf", "--model", HF_DIR], "needs a .gguf model"),
                          (["--cpu-isa", "neon"], "invalid choice"), (["--weights", "q4"], "invalid choice")):  # fmt: skip
        with pytest.raises(SystemExit):
            args.parse_args(argv)
        assert message in capsys.readouterr().err


def test_llm_keywords() -> None:
    engine, _ = split_config(None, {"weights": "float32", "cpu_isa": "portable"})
    assert engine.weights == "float32" and engine.kernels.cpu_isa == "portable"
