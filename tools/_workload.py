"""The offline benchmark's workload and a warmed-up `LLM` for the tools in this folder:
`setup(["MODEL", *bench offline args])` (default model configs/qwen3-0.6b, dummy weights)."""

from __future__ import annotations

from typing import Any

from minisgl.bench.offline import build_parser, make_llm, make_workload


def setup(argv: list[str]) -> tuple[Any, list[list[int]], list[int], Any]:
    """-> (args, prompts, output lengths, an `LLM` already warmed up once)."""
    argv = list(argv)
    model = argv.pop(0) if argv and not argv[0].startswith("-") else "configs/qwen3-0.6b"
    args = build_parser().parse_args(["--model", model, "--dummy-weights", *argv])
    prompts, outputs = make_workload(args)
    llm, _ = make_llm(args)
    return args, prompts, outputs, llm
