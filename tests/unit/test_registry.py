from __future__ import annotations

from collections.abc import Callable

import pytest

from minisgl.utils.registry import Registry


def test_register_get_names_and_meta() -> None:
    reg: Registry[Callable[[], str]] = Registry("sampler")

    @reg.register("greedy", platforms=("cpu", "cuda"))
    def make_greedy() -> str:
        return "greedy"

    @reg.register("topk")
    def make_topk() -> str:
        return "topk"

    assert reg.get("greedy") is make_greedy and reg.get("topk")() == "topk"
    assert reg.names() == ["greedy", "topk"]
    assert reg.meta("greedy") == {"platforms": ("cpu", "cuda")}
    assert reg.meta("topk") == {}
    assert "greedy" in reg and "beam" not in reg


def test_unknown_name_is_a_value_error_listing_choices() -> None:
    reg: Registry[int] = Registry("attention backend")
    reg.register("fa")(1)
    reg.register("torch")(2)
    with pytest.raises(ValueError, match=r"unknown attention backend 'x'; valid choices: fa, torch"):
        reg.get("x")
    with pytest.raises(ValueError):
        reg.meta("x")


def test_duplicate_registration_is_rejected() -> None:
    reg: Registry[int] = Registry("thing")
    reg.register("a")(1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(2)
    assert reg.get("a") == 1
