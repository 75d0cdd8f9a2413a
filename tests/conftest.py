from __future__ import annotations

import os

# Tests run on CPU with deterministic kernels and never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
