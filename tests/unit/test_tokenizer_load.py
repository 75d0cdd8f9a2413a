"""The tokenizer process's tokenizer: transformers' generic class loaded without AutoTokenizer
(which imports torch) gives what AutoTokenizer gives, and the process never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from minisgl.models.source import resolve_model_dir
from minisgl.tokenizer.chat import ChatRenderer
from minisgl.tokenizer.request import generic_tokenizer_dir, load_hf_tokenizer
from minisgl.message.tokenizer import ChatPrompt

TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnew lines", "héllo wörld 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", ""]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "and again"}],
]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def embedded_dir() -> str:
    """The embedded SmolLM2 GGUF's tokenizer directory (what the server's tokenizer loads)."""
    return str(resolve_model_dir(None, float_weights=False))


def test_generic_class_equals_auto_tokenizer(embedded_dir: str) -> None:
    assert generic_tokenizer_dir(embedded_dir)
    ours, auto = load_hf_tokenizer(embedded_dir), AutoTokenizer.from_pretrained(embedded_dir)
    assert type(ours) is type(auto)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == auto.encode(text, add_special_tokens=special)
    ids = auto.encode(" ".join(TEXTS))
    assert ours.decode(ids) == auto.decode(ids)
    assert ours.chat_template == auto.chat_template
    for messages in CHATS:
        for tools in ([], TOOLS):
            prompt = ChatPrompt(messages=messages, tools=tools)
            assert ChatRenderer(ours).render(prompt) == ChatRenderer(auto).render(prompt)


def test_other_tokenizer_dirs_use_auto_tokenizer(tmp_path: Path, embedded_dir: str) -> None:
    assert not generic_tokenizer_dir(str(tmp_path))  # no tokenizer.json
    (tmp_path / "tokenizer.json").write_text(Path(embedded_dir, "tokenizer.json").read_text())
    assert not generic_tokenizer_dir(str(tmp_path))  # no tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    assert not generic_tokenizer_dir(str(tmp_path))  # a model-specific class: AutoTokenizer picks it
    (tmp_path / "tokenizer_config.json").write_text("not json")
    assert not generic_tokenizer_dir(str(tmp_path))


def test_tokenizer_process_imports_no_torch(embedded_dir: str) -> None:
    code = (
        "import sys\n"
        "from minisgl.tokenizer.request import RequestTokenizer, load_hf_tokenizer\n"
        "from minisgl.tokenizer.worker import run_tokenizer\n"
        "from minisgl.message.tokenizer import ChatPrompt, EngineLimitsMsg, TokenizeMsg\n"
        "from minisgl.core import SamplingParams\n"
        f"worker = RequestTokenizer(load_hf_tokenizer({embedded_dir!r}), EngineLimitsMsg(8192, 49152, 100000))\n"
        "prompt = ChatPrompt(messages=[{'role': 'user', 'content': 'hi'}])\n"
        "out = worker.handle(TokenizeMsg(rid=1, prompt=prompt, sampling=SamplingParams(max_tokens=4)))\n"
        "assert out.input_ids, out\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
