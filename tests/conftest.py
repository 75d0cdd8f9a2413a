from __future__ import annotations

import os

# Tests run on CPU with deterministic kernels and never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton must be put in interpreter mode before anything imports it (it decorates its own
# library functions at import), so decide here, once, for the whole session.
import torch  # noqa: E402

if not torch.cuda.is_available():
    from minisgl.kernels.interpret import use_triton_interpreter

    use_triton_interpreter()
