"""OpenAI request parsing: strict validation, one clear message naming the field."""

from __future__ import annotations

import json

import pytest

from minisgl.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    RequestError,
    parse_request,
)

MSG = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse_request(ChatCompletionRequest, json.dumps({"model": "m", "messages": MSG, **fields}).encode())


def bad_chat(**fields) -> RequestError:
    with pytest.raises(RequestError) as info:
        chat(**fields)
    return info.value


def test_minimal_chat_defaults():
    req = chat()
    sampling, explicit = req.sampling(default_max_tokens=100)
    assert not explicit and sampling.max_tokens == 100 and sampling.temperature == 1.0
    assert req.stream is False and req.n == 1 and req.stop_list() == []


def test_chat_sampling_fields():
    req = chat(max_completion_tokens=7, temperature=0, top_p=0.5, top_k=-1, min_p=0.1, seed=3,
               stop="END", ignore_eos=True, stream=True, stream_options={"include_usage": True},
               user="u", metadata={"a": "b"}, frequency_penalty=0)  # fmt: skip
    sampling, explicit = req.sampling(100)
    assert explicit and sampling.max_tokens == 7 and sampling.greedy and sampling.top_k is None
    assert sampling.top_p == 0.5 and sampling.min_p == 0.1 and sampling.seed == 3 and sampling.ignore_eos
    assert req.stop_list() == ["END"] and req.include_usage


def test_content_parts_and_developer_role():
    req = chat(messages=[{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": None}, {"role": "user", "content": "c", "name": "x"}])  # fmt: skip
    assert req.messages[0] == {"role": "system", "content": "be brief"}
    assert req.messages[1]["content"][1]["text"] == "b"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"stream": "yes"}, "stream"),
        ({"stop": 5}, "stop"),
        ({"n": 0}, "n"),
        ({"seed": "x"}, "seed"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": 1}, "presence_penalty"),
        ({"logprobs": True}, "logprobs"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"unknown_knob": 1}, "unknown_knob"),
    ],
)
def test_bad_chat_fields(fields, param):
    err = bad_chat(**fields)
    assert err.status == 400
    assert err.param == param or (err.param or "").startswith(param), (err.param, str(err))
    assert param.split(".")[0] in str(err) or "role" in str(err) or "content" in str(err)


@pytest.mark.parametrize("body", [b"{", b"", b"[]", b'"x"', b"null", b"{\"messages\": [}"])
def test_malformed_bodies(body):
    with pytest.raises(RequestError) as info:
        parse_request(ChatCompletionRequest, body)
    assert info.value.status == 400


def test_missing_messages_names_field():
    with pytest.raises(RequestError) as info:
        parse_request(ChatCompletionRequest, b"{}")
    assert info.value.param == "messages" and "messages" in str(info.value)


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    req = parse_request(CompletionRequest, json.dumps({"prompt": prompt, "max_tokens": 3}).encode())
    assert req.prompts() == expected


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[1], []], [[1, "x"]], 5, None, [True]])
def test_bad_completion_prompts(prompt):
    with pytest.raises(RequestError) as info:
        parse_request(CompletionRequest, json.dumps({"prompt": prompt}).encode())
    assert info.value.param == "prompt"


@pytest.mark.parametrize("fields", [{"echo": True}, {"suffix": "x"}, {"best_of": 3}, {"logprobs": 2}])
def test_unsupported_completion_fields(fields):
    with pytest.raises(RequestError) as info:
        parse_request(CompletionRequest, json.dumps({"prompt": "p", **fields}).encode())
    assert info.value.param == next(iter(fields))


def test_generate_request():
    req = parse_request(GenerateRequest, b'{"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}')
    sp = req.sampling()
    assert sp.max_tokens == 4 and sp.greedy
    for body in (b'{"text": "a", "input_ids": [1]}', b"{}", b'{"text": "a", "sampling_params": {"top_p": 0}}',
                 b'{"text": "a", "sampling_params": {"bogus": 1}}'):  # fmt: skip
        with pytest.raises(RequestError):
            r = parse_request(GenerateRequest, body)
            r.sampling()
