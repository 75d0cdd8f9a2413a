"""The command line: access options (--api-key, or the environment's key, and --cors-origins),
and every behaviour switch of the engine, kernel and scheduler configs as a flag of
`python -m minisgl` and of `python -m minisgl.bench offline` (the list is derived from the config
dataclasses, so a new switch field without a flag fails here)."""

from __future__ import annotations

import subprocess
import sys
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest

from minisgl.engine.config import EngineConfig
from minisgl.env import API_KEY_VAR, Env
from minisgl.platform.kernel_config import KernelConfig
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server import args

REPO = Path(__file__).resolve().parents[2]
# Switch fields whose flag is not `--` + the field name with dashes.
FLAG_NAMES = {"overlap": "overlap-schedule"}
CONFIGS: dict[str, type] = {"engine": EngineConfig, "kernels": KernelConfig, "scheduler": SchedulerConfig}


def _switches() -> list[tuple[str, str, Any]]:
    """(config, field, default) of every bool or bool | None field of the configs."""
    found = []
    for where, cls in CONFIGS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if hints[f.name] in (bool, bool | None):
                default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
                found.append((where, f.name, default))
    return found


def _flag(name: str) -> str:
    return "--" + FLAG_NAMES.get(name, name.replace("_", "-"))


def _field(config: args.ServerConfig, where: str, name: str) -> Any:
    holder = {"engine": config.engine, "kernels": config.engine.kernels, "scheduler": config.sched}[where]
    return getattr(holder, name)


def test_switches_found() -> None:
    names = {name for _, name, _ in _switches()}
    assert {"overlap", "pad_eager", "fused_kernels", "pdl", "fold_norms", "triton_gemm", "decode_tuned",
            "cpu_kernels", "cpu_attn_kernel", "dummy_weights"} <= names  # fmt: skip


@pytest.mark.parametrize("command", [["-m", "minisgl"], ["-m", "minisgl.bench", "offline"]])
def test_help_lists_every_switch(command: list[str]) -> None:
    res = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    for _, name, default in _switches():
        assert _flag(name) in res.stdout, name
        if default is not False:  # on by default, or the platform's choice: it can be turned off
            assert "--no-" + _flag(name)[2:] in res.stdout, name


def test_every_switch_reaches_its_field() -> None:
    defaults = args.parse_args([])
    for where, name, default in _switches():
        assert _field(defaults, where, name) == default, name
        assert _field(args.parse_args([_flag(name)]), where, name) is True, name
        if default is not False:
            assert _field(args.parse_args(["--no-" + _flag(name)[2:]]), where, name) is False, name


def test_bench_offline_takes_the_same_engine_flags() -> None:
    from minisgl.bench import offline
    from minisgl.server.engine_args import engine_config, scheduler_config

    argv = ["--no-pdl", "--no-overlap-schedule", "--pad-eager", "--no-cpu-kernels", "--dtype", "float32",
            "--page-size", "4", "--max-running-requests", "8"]  # fmt: skip
    bench = offline.build_parser().parse_args(argv)
    server = args.parse_args(argv)
    assert engine_config(bench) == server.engine
    # The one difference: offline runs default to the platform's prefill budget.
    assert scheduler_config(bench) == SchedulerConfig(**{**server.sched.__dict__, "max_prefill_tokens": None})


def test_api_key_and_cors_flags():
    config = args.parse_args(["--api-key", "k1", "--cors-origins", "http://a.test", "http://b.test"])
    assert config.api_key == "k1" and config.cors_origins == ("http://a.test", "http://b.test")
    assert args.parse_args([]).cors_origins == ()


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_VAR, "from-env")
    monkeypatch.setattr(args, "ENV", Env.read())
    assert args.parse_args([]).api_key == "from-env"
    assert args.parse_args(["--api-key", "flag"]).api_key == "flag"  # the flag wins
    monkeypatch.delenv(API_KEY_VAR)
    monkeypatch.setattr(args, "ENV", Env.read())
    assert args.parse_args([]).api_key is None


def test_empty_api_key_refused(capsys):
    with pytest.raises(SystemExit):
        args.parse_args(["--api-key", " "])
    assert "--api-key" in capsys.readouterr().err


def test_multinode_settings_cover_every_field() -> None:
    """The settings two nodes of a launch compare (server/cluster.py) hold every engine, kernel and
    scheduler field (but the model path and the rank), and a differing switch shows up by name."""
    from minisgl.server.cluster import launch_settings

    settings = launch_settings(args.parse_args([]), ["llama", 1])
    expected = {f"engine.{f.name}" for f in fields(EngineConfig) if f.name not in ("model", "tp_rank", "kernels")}
    expected |= {f"engine.kernels.{f.name}" for f in fields(KernelConfig)}
    expected |= {f"scheduler.{f.name}" for f in fields(SchedulerConfig)}
    assert expected | {"dp", "nnodes", "model"} == set(settings)
    for where, name, default in _switches():
        key = {"engine": "engine.", "kernels": "engine.kernels.", "scheduler": "scheduler."}[where] + name
        other = launch_settings(args.parse_args([_flag(name) if default is False else "--no-" + _flag(name)[2:]]),
                                ["llama", 1])  # fmt: skip
        assert [k for k in settings if settings[k] != other[k]] == [key], name


def test_server_prefill_budget_follows_the_device() -> None:
    """--max-prefill-tokens unset: 8192 on a GPU, 2048 on CPU (docs/performance.md); set, it wins;
    an offline parser leaves it to the platform's offline budget (None)."""
    from minisgl.bench import offline
    from minisgl.server.engine_args import scheduler_config

    assert args.parse_args(["--device", "cpu"]).sched.max_prefill_tokens == 2048
    assert args.parse_args(["--device", "cuda"]).sched.max_prefill_tokens == 8192
    assert args.parse_args(["--device", "cpu", "--max-prefill-tokens", "8192"]).sched.max_prefill_tokens == 8192
    assert scheduler_config(offline.build_parser().parse_args(["--device", "cpu"])).max_prefill_tokens is None
