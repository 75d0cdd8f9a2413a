"""A tiny random-weight Qwen3 checkpoint whose tokenizer and chat template speak `<think>`.

The vocabulary is small (64 words) so a sampled reply meets `</think>` within a few dozen tokens.
The template is Qwen3's thinking form: the generation prompt opens `<think>` unless
`enable_thinking` is false, which writes an empty, closed think block instead. Decoding joins
words with spaces (a WordLevel tokenizer without a decoder)."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 64
SPECIAL = ("<|im_start|>", "<|im_end|>")
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}"
)


def make_thinking_model(path: Path, seed: int = 0) -> Path:
    import torch
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    words = ["[UNK]", *SPECIAL, *TAGS]
    words += [f"w{i}" for i in range(VOCAB_SIZE - len(words))]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False) for t in TAGS])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "unk_token": "[UNK]",
              "pad_token": "<|im_end|>", "chat_template": TEMPLATE, "clean_up_tokenization_spaces": False,
              "model_max_length": 512}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    model_config = tf.Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=vocab["<|im_end|>"], bos_token_id=None, pad_token_id=vocab["<|im_end|>"],
    )  # fmt: skip
    torch.manual_seed(seed)
    tf.Qwen3ForCausalLM(model_config).eval().save_pretrained(path)
    return path
