from __future__ import annotations

import os

# Tests run on CPU with deterministic kernels and never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton must be put in interpreter mode before anything imports it (it decorates its own
# library functions at import), so decide here, once, for the whole session.
import torch  # noqa: E402

if not torch.cuda.is_available():
    # `--dtype auto` is bf16 on CPUs with native bf16; the suite's exactness checks (HF parity,
    # batched == single, served == offline) are stated for fp32, so pin it here (servers started
    # by the tests inherit it). tests/golden/test_cpu_bf16.py covers the bf16 default itself.
    os.environ.setdefault("MINISGL_DEFAULT_DTYPE", "float32")
    from minisgl.kernels.interpret import use_triton_interpreter

    use_triton_interpreter()
