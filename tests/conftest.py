from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.e2e.service import Server

# Tests run on CPU with deterministic kernels and never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton must be put in interpreter mode before anything imports it (it decorates its own
# library functions at import), so decide here, once, for the whole session.
import torch  # noqa: E402

if not torch.cuda.is_available():
    from minisgl.kernels.interpret import use_triton_interpreter

    use_triton_interpreter()

# After the interpreter is chosen: minisgl.env reads TRITON_INTERPRET when first imported.
import minisgl.platform.cpu as cpu_platform  # noqa: E402

# The CPU's real answer, before the pin below (tests/golden/test_cpu_bf16.py checks `--dtype auto`
# against it through the `native_cpu_dtype` fixture).
_NATIVE_BF16: Callable[[], bool] = cpu_platform.cpu_has_native_bf16

if not torch.cuda.is_available():
    # `--dtype auto` is bf16 on CPUs with native bf16; the suite's exactness checks (HF parity,
    # batched == single, served == offline) are stated for fp32, so the in-process engines see a
    # CPU without native bf16, and the servers the tests start get `--dtype float32`
    # (tests/e2e/service.py: CPU_ARGS). tests/golden/test_cpu_bf16.py covers the bf16 default.
    cpu_platform.cpu_has_native_bf16 = lambda: False


@pytest.fixture
def native_cpu_dtype(monkeypatch: pytest.MonkeyPatch) -> torch.dtype:
    """Lift the fp32 pin for one test: `--dtype auto` follows the CPU again; returns what it picks."""
    monkeypatch.setattr(cpu_platform, "cpu_has_native_bf16", _NATIVE_BF16)
    return torch.bfloat16 if _NATIVE_BF16() else torch.float32


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The plain default server (embedded model, `python -m minisgl --device cpu`: its GGUF blocks
    kept quantized, tests/e2e/service.py DEFAULT_ARGS), one per session:
    tests/conformance and every tests/e2e module that only sends requests share it (a start costs
    tens of seconds on 2 cores). Tests that kill, stop or reconfigure a server start their own."""
    from tests.e2e.service import DEFAULT_ARGS, start_server

    srv = start_server(tmp_path_factory, "server", base=DEFAULT_ARGS)
    yield srv
    srv.stop()
