"""Measured launch tables: JSON files under `kernels/tuned/` (package data), each keyed by device
name and shape and saying which command produced it (`produced_by`), loaded once.

A table only ever picks among launches the kernel also runs without it: a device or shape it does
not list takes the kernel's heuristic, so a missing or foreign table costs speed, never results.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

import torch


@functools.cache
def load_table(name: str) -> dict[str, Any]:
    """`kernels/tuned/<name>.json`."""
    text = (resources.files("minisgl.kernels") / "tuned" / f"{name}.json").read_text(encoding="utf-8")
    table: dict[str, Any] = json.loads(text)
    assert table.get("produced_by"), f"tuned/{name}.json must say which command produced it"
    return table


@functools.cache
def device_name(device: torch.device) -> str:
    """The name the tables key a device by (`torch.cuda.get_device_name`, e.g. "NVIDIA H200");
    other devices by their type ("cpu")."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return device.type
