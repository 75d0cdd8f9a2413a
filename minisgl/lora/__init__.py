"""Multi-LoRA serving: PEFT adapters read from disk (`adapter.py`), their weights in a fixed set
of device slots shared by every layer (`manager.py`), and the per-layer delta that the linear
layers add to their output through the segmented matmul of `kernels/lora.py` (`layer.py`)."""
