"""Reasoning parsers (tokenizer/reasoning.py) and their hook points: the detokenizer splits the
emitted text (after stop strings), the tokenizer stage says where a reply starts, the chat
choice parses tool calls from the answer only."""

from __future__ import annotations

import pytest

from minisgl.message.frontend import TextDelta
from minisgl.message.tokenizer import ChatPrompt, DetokFacts, TokenizeMsg, TokenOut
from minisgl.server.choice import ChoiceOptions, ChoiceState
from minisgl.server.responses import ResponseBuilder
from minisgl.tokenizer.incremental import IncrementalDetokenizer
from minisgl.tokenizer.reasoning import (
    REASONING_PARSERS,
    make_reasoning_parser,
    reasoning_parser_class,
    thinking_disabled,
)


def split(name: str, chunks: list[str], in_reasoning: bool = False) -> tuple[str, str]:
    parser = make_reasoning_parser(name, in_reasoning)
    reasoning, content = [], []
    for chunk in chunks:
        part = parser.feed(chunk)
        reasoning.append(part.reasoning)
        content.append(part.content)
    part = parser.finish()
    return "".join(reasoning) + part.reasoning, "".join(content) + part.content


def chars(text: str) -> list[str]:
    return list(text)


QWEN = "<think>\nLet me think.\nStill thinking.\n</think>\n\nThe answer is 4."


@pytest.mark.parametrize("chunking", [lambda t: [t], chars, lambda t: [t[i : i + 3] for i in range(0, len(t), 3)]])
def test_qwen3_split_whole_and_across_chunks(chunking):
    assert split("qwen3", chunking(QWEN)) == ("Let me think.\nStill thinking.", "The answer is 4.")


def test_qwen3_streamed_parts_hold_only_possible_tags():
    parser = make_reasoning_parser("qwen3", False)
    assert parser.feed("<thi") == ("", "")  # maybe <think>
    assert parser.feed("nk>abc</th") == ("abc", "")  # "</th" held
    assert parser.feed("ink>Hi") == ("", "Hi")
    assert parser.feed(" there <think> x") == ("", " there <think> x")  # only a leading <think> opens
    assert parser.finish() == ("", "")


def test_qwen3_without_think_is_all_answer():
    assert split("qwen3", chars("Hello, no thinking here.")) == ("", "Hello, no thinking here.")
    assert split("qwen3", [" ", "Hi"]) == ("", " Hi")


def test_qwen3_prompt_opened_think():
    # The template put "<think>\n" in the prompt: the reply starts inside the thinking.
    cls = reasoning_parser_class("qwen3")
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert cls.starts_in_reasoning(prompt, thinking=True)
    assert not cls.starts_in_reasoning(prompt, thinking=False)
    assert not cls.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", thinking=True)
    assert not cls.starts_in_reasoning("<|im_start|>assistant\n", thinking=True)
    assert split("qwen3", chars("step one\n</think>\n\nDone."), in_reasoning=True) == ("step one", "Done.")


def test_thinking_disabled_kwargs():
    assert thinking_disabled({"enable_thinking": False})
    assert thinking_disabled({"thinking": False})
    assert not thinking_disabled({"enable_thinking": True})
    assert not thinking_disabled({})


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_cut_inside_a_tag_leaks_nothing(name):
    # max_tokens or a stop string ended the reply in the middle of a tag.
    assert split(name, chars("<think>abc</thi"), in_reasoning=False) == ("abc", "")
    assert split(name, ["<thi"], in_reasoning=name == "deepseek_r1") == ("", "")
    assert split(name, chars("<think>never closed\n")) == ("never closed", "")


def test_deepseek_r1_starts_as_reasoning():
    cls = reasoning_parser_class("deepseek_r1")
    assert cls.starts_in_reasoning("<｜Assistant｜>", thinking=True)
    assert cls.starts_in_reasoning("<｜Assistant｜><think>\n", thinking=True)
    assert not cls.starts_in_reasoning("<｜Assistant｜></think>", thinking=True)  # the template closed it
    assert not cls.starts_in_reasoning("<｜Assistant｜>", thinking=False)
    assert split("deepseek_r1", chars("reason</think>answer"), in_reasoning=True) == ("reason", "answer")
    assert split("deepseek_r1", chars("<think>reason</think>answer"), in_reasoning=True) == ("reason", "answer")
    assert split("deepseek_r1", ["all thinking, cut"], in_reasoning=True) == ("all thinking, cut", "")


HARMONY = ("<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>4<|return|>")  # fmt: skip


@pytest.mark.parametrize("chunking", [lambda t: [t], chars])
def test_gpt_oss_channels(chunking):
    assert split("gpt_oss", chunking(HARMONY)) == ("User asks 2+2. Easy.", "4")


def test_gpt_oss_function_call_becomes_a_tool_call_block():
    text = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')  # fmt: skip
    reasoning, content = split("gpt_oss", chars(text))
    assert reasoning == "Need weather."
    assert content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_gpt_oss_prompt_state_and_plain_text():
    cls = reasoning_parser_class("gpt_oss")
    assert not cls.starts_in_reasoning("<|start|>user<|message|>hi<|end|><|start|>assistant", thinking=True)
    assert cls.starts_in_reasoning("<|start|>assistant<|channel|>analysis<|message|>", thinking=True)
    assert split("gpt_oss", ["thinking<|end|><|start|>assistant<|channel|>final<|message|>ok"], True) == ("thinking", "ok")
    assert split("gpt_oss", ["no harmony at all"]) == ("", "no harmony at all")
    assert split("gpt_oss", chars("<|channel|>analysis<|message|>cut<|en")) == ("cut", "")


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser_class("nope")
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1", "gpt_oss"}


# ---------------------------------------------------------------- the detokenizer's hook


tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tok():  # byte-level BPE without merges (every byte a token) plus the think tags and harmony markers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken(m, special=True) for m in
                          ("<eos>", "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>")])  # fmt: skip
    t.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    return t


def detokenize(tok, text: str, parser: str | None, in_reasoning: bool = False, stop: list[str] | None = None,
               step: int = 1) -> list[TextDelta]:  # fmt: skip
    detok = IncrementalDetokenizer(lambda s: tok.decode_batch(s, skip_special_tokens=True), None,
                                   lambda s: tok.decode_batch(s, skip_special_tokens=False))  # fmt: skip
    detok.register(DetokFacts(rid=1, prompt_tail_ids=tok.encode("A:").ids, stop=stop or [],
                              reasoning_parser=parser, in_reasoning=in_reasoning))  # fmt: skip
    ids = tok.encode(text).ids
    deltas: list[TextDelta] = []
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        result = detok.process([TokenOut(1, ids[i : i + step], "length" if last else None, 3, 0, i + step)])
        deltas += result.deltas
        if deltas and deltas[-1].finish_reason is not None:
            break
    assert detok.states == {}
    return deltas


def joined(deltas: list[TextDelta]) -> tuple[str, str]:
    return "".join(d.reasoning for d in deltas), "".join(d.text for d in deltas)


@pytest.mark.parametrize("step", [1, 4])
def test_detokenizer_splits_qwen3(tok, step):
    deltas = detokenize(tok, QWEN, "qwen3", step=step)
    assert joined(deltas) == ("Let me think.\nStill thinking.", "The answer is 4.")
    assert deltas[-1].finish_reason == "length"


def test_detokenizer_without_parser_keeps_the_tags(tok):
    assert joined(detokenize(tok, "<think>x</think>y", None)) == ("", "<think>x</think>y")


def test_stop_string_inside_the_thinking_leaks_no_tag(tok):
    # The stop string is cut before the reasoning parser sees the text: no tag, whole or in part.
    deltas = detokenize(tok, "<think>one STOP two</think>answer", "qwen3", stop=["STOP"])
    assert joined(deltas) == ("one ", "")
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "STOP"
    deltas = detokenize(tok, "<think>one</think>answer. more", "qwen3", stop=["."])
    assert joined(deltas) == ("one", "answer")
    deltas = detokenize(tok, "<think>one</thSTOP", "qwen3", stop=["STOP"])  # cut inside the closing tag
    assert joined(deltas) == ("one", "")


def test_detokenizer_keeps_special_tokens_for_harmony(tok):
    assert joined(detokenize(tok, HARMONY, "gpt_oss")) == ("User asks 2+2. Easy.", "4")
    assert joined(detokenize(tok, "<|channel|>final<|message|>x<|return|>", None)) == ("", "finalx")


# ---------------------------------------------------------------- tokenizer stage and chat choice


class _Tok:
    """A stand-in HF tokenizer: a Qwen3-like template whose generation prompt opens <think>
    unless enable_thinking is false."""

    chat_template = "{{ x }}"

    def apply_chat_template(self, messages, chat_template, tokenize, add_generation_prompt, **kwargs):  # type: ignore[no-untyped-def]
        text = "".join(f"<|{m['role']}|>{m['content']}" for m in messages) + "<|assistant|>"
        if kwargs.get("enable_thinking") is False:
            return text + "<think>\n\n</think>\n\n"
        return text + "<think>\n"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 50 for c in text]


@pytest.mark.parametrize("kwargs, opened", [({}, True), ({"enable_thinking": False}, False)])
def test_request_tokenizer_says_where_the_reply_starts(kwargs, opened):
    from minisgl.message.tokenizer import EngineLimitsMsg
    from minisgl.tokenizer.request import RequestTokenizer

    limits = EngineLimitsMsg(context_len=4096, vocab_size=50, pool_tokens=1 << 20)
    worker = RequestTokenizer(_Tok(), limits, "qwen3")
    msg = TokenizeMsg(3, ChatPrompt([{"role": "user", "content": "hi"}], [], kwargs))
    facts = worker.tokenize(msg).msg.facts
    assert facts is not None and facts.reasoning_parser == "qwen3" and facts.in_reasoning is opened
    from minisgl.message.tokenizer import TextPrompt

    plain = worker.tokenize(TokenizeMsg(4, TextPrompt("hi"))).msg.facts  # completions: no split
    assert plain is not None and plain.reasoning_parser is None
    from minisgl.core import SamplingParams

    # A grammar-constrained reply (json_schema, forced tool call) is the answer from its first token.
    json_msg = TokenizeMsg(5, msg.prompt, SamplingParams(json_schema='{"type": "object"}'))
    constrained = worker.tokenize(json_msg).msg.facts
    assert constrained is not None and constrained.reasoning_parser is None
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        RequestTokenizer(_Tok(), limits, "bogus")


def test_tool_calls_are_parsed_from_the_answer_only():
    options = ChoiceOptions(tool_mode="auto", tool_names=("get_weather",))
    state = ChoiceState(options)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    # A tool call written inside the thinking is thinking, not a call.
    state.add(TextDelta(1, "", reasoning="maybe " + call))
    update = state.add(TextDelta(1, call, finish_reason="stop", prompt_tokens=3, completion_tokens=9))
    assert state.reasoning == "maybe " + call
    assert state.calls and state.calls[0]["function"]["name"] == "get_weather"
    assert update.finish_reason == "tool_calls" and state.text == ""


def test_chat_objects_carry_reasoning_content():
    builder = ResponseBuilder("chat", "m", [1], True, ChoiceOptions())
    builder.add(TextDelta(1, "", reasoning="think"))
    builder.add(TextDelta(1, "answer", finish_reason="stop", prompt_tokens=2, completion_tokens=3))
    message = builder.full()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "answer", "reasoning_content": "think", "reasoning": "think"}
    stream = ResponseBuilder("chat", "m", [1], True, ChoiceOptions())
    chunk = stream.delta_chunk(TextDelta(1, "", reasoning="th"))
    assert chunk is not None and b'"delta":{"reasoning_content":"th","reasoning":"th"}' in chunk
    plain = ResponseBuilder("chat", "m", [1], True, ChoiceOptions())
    plain.add(TextDelta(1, "x", finish_reason="stop"))
    assert "reasoning_content" not in plain.full()["choices"][0]["message"]
