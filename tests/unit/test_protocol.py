"""OpenAI request parsing: strict validation, one clear message naming the field."""

from __future__ import annotations

import json

import pytest

from minisgl.core import SamplingError, SamplingParams
from minisgl.server.chat_protocol import ChatCompletionRequest
from minisgl.server.protocol import CompletionRequest, GenerateRequest, RequestError, parse_request

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
        ({"messages": [{"role": 5, "content": "x"}]}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages"),  # no role
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                       {"role": "assistant", "content": "c"}]}, "messages"),  # two trailing assistant turns
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # no tool_call_id
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                        "function": {"name": "f", "arguments": {"a": 1}}}]}]}, "messages"),  # fmt: skip
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"regex": "(unclosed"}, "regex"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "g"}},
          "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # fmt: skip
        ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}],
          "response_format": {"type": "json_object"}}, "tool_choice"),  # fmt: skip
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}},
         "response_format"),
        ({"response_format": {"type": "json_object", "schema": 123}}, "response_format"),
        ({"response_format": {"type": "json_object", "schema": {"type": "hiccup"}}}, "response_format"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": "x" * 1001}, "stop"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
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


@pytest.mark.parametrize("fields", [{"suffix": "x"}, {"best_of": 3}, {"logprobs": 21}, {"logprobs": -1}])
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


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}  # fmt: skip


def test_penalties_bias_and_extensions_map_to_sampling():
    req = chat(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, logit_bias={"42": 100, "7": -5.5},
               min_tokens=2, max_tokens=9, seed=11, stop_token_ids=[3, 4], include_stop_str_in_output=True,
               regex="[a-z]+")  # fmt: skip
    sp, _ = req.sampling(100)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.2)
    assert sp.logit_bias == {42: 100.0, 7: -5.5} and sp.min_tokens == 2 and sp.seed == 11
    assert sp.stop_token_ids == [3, 4] and sp.regex == "[a-z]+" and req.include_stop_str_in_output
    assert sp.logprobs is None and sp.json_schema is None and not sp.json_object


def test_chat_logprobs_and_response_formats():
    assert chat(logprobs=True).sampling(10)[0].logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).sampling(10)[0].logprobs == 5
    assert chat(response_format={"type": "json_object"}).sampling(10)[0].json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    sp = chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}})
    assert json.loads(sp.sampling(10)[0].json_schema) == schema
    assert chat(response_format={"type": "text"}).sampling(10)[0].json_schema is None


def test_completion_logprobs_and_echo():
    req = parse_request(CompletionRequest, json.dumps({"prompt": "p", "logprobs": 3, "echo": True}).encode())
    sp, _ = req.sampling(16)
    assert sp.logprobs == 3 and sp.prompt_logprobs == 3
    req = parse_request(CompletionRequest, json.dumps({"prompt": "p", "echo": True}).encode())
    assert req.sampling(16)[0].prompt_logprobs is None


def test_tools_and_tool_choice_modes():
    assert chat(tools=[TOOL]).tool_mode == "auto"
    assert chat().tool_mode == "none" and chat(tool_choice="none").tool_mode == "none"
    assert chat(tools=[TOOL], tool_choice="none").prompt_tools() == []
    req = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert req.tool_mode == "named" and req.forced_tool == "get_weather"
    assert json.loads(req.sampling(10)[0].json_schema) == TOOL["function"]["parameters"]
    req = chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(req.sampling(10)[0].json_schema)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert schema["items"]["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}


def test_tool_turns_in_history():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    req = chat(tools=[TOOL], messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])  # fmt: skip
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert req.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_messages_lenient_like_vllm():
    req = chat(messages=[{"role": "system", "content": "s", "extra_field": 1, "refusal": "no"},
                         {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}],
                          "weight": 0.5},
                         {"role": "observation", "content": "custom role", "name": "env"},
                         {"role": "assistant", "content": None, "audio": {"id": "x"},
                          "tool_calls": [{"id": "c", "type": "function", "extra": 1,
                                          "function": {"name": "f", "arguments": "{}", "x": 2}}]}])  # fmt: skip
    assert req.messages[0] == {"role": "system", "content": "s"}
    assert req.messages[2] == {"role": "observation", "content": "custom role", "name": "env"}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert req.messages[3]["tool_calls"] == [call]


def test_logit_bias_error_names_every_bad_key():
    err = bad_chat(logit_bias={"abc": 1.0, "7": 1.0, "x-1": 2.0})
    assert err.param == "logit_bias" and "'abc'" in str(err) and "'x-1'" in str(err)
    err = bad_chat(logit_bias={"1": 101, "2": 0, "3": -300})
    assert "1 (101" in str(err) and "3 (-300" in str(err) and "2 (" not in str(err)


def test_seed_bounds_are_int64():
    for seed in (-(2**63), -1, 0, 2**63 - 1):
        assert chat(seed=seed).seed == seed


def test_response_format_llama_cpp_forms():
    params = chat(response_format={"type": "json_object", "schema": {"const": "42"}}).sampling(8)[0]
    assert json.loads(params.json_schema) == {"const": "42"} and not params.json_object
    params = chat(response_format={"type": "json_schema", "json_schema": {"schema": {"const": "f"}}}).sampling(8)[0]
    assert json.loads(params.json_schema) == {"const": "f"}  # the name is optional
    assert chat(response_format={"type": "json_object"}).sampling(8)[0].json_object


@pytest.mark.parametrize(
    "body_field, value, field",
    [("n", 0, "n"), ("n", 65, "n"), ("temperature", -0.5, "temperature"), ("top_p", 0.0, "top_p"),
     ("top_k", -5, "top_k"), ("min_p", 2.0, "min_p"), ("max_tokens", 0, "max_tokens"),
     ("max_completion_tokens", 0, "max_tokens"), ("min_tokens", -1, "min_tokens"), ("seed", 2**63, "seed"),
     ("frequency_penalty", 2.5, "frequency_penalty"), ("presence_penalty", -3.0, "presence_penalty"),
     ("repetition_penalty", 0.0, "repetition_penalty"), ("stop", ["x"] * 17, "stop"), ("stop", "x" * 1001, "stop"),
     ("stop_token_ids", [-1], "stop_token_ids"), ("stop_token_ids", list(range(257)), "stop_token_ids")],
)  # fmt: skip
def test_sampling_values_are_checked_by_sampling_params_alone(body_field, value, field):
    """The body's 400 is SamplingParams' own error, naming the body's field: one set of rules."""
    with pytest.raises(SamplingError) as rule:
        SamplingParams(**{field: value})
    err = bad_chat(**{body_field: value})
    assert (err.param, str(err)) == (body_field, rule.value.renamed(body_field))


def test_logit_bias_and_logprob_rules_come_from_sampling_params():
    with pytest.raises(SamplingError) as rule:
        SamplingParams(logit_bias={5: 101.0})
    assert str(bad_chat(logit_bias={"5": 101})) == str(rule.value)
    with pytest.raises(SamplingError) as rule:
        SamplingParams(logprobs=21)
    err = bad_chat(logprobs=True, top_logprobs=21)
    assert (err.param, str(err)) == ("top_logprobs", rule.value.renamed("top_logprobs"))
    err = parse_error(CompletionRequest, {"prompt": "p", "logprobs": 21, "echo": True})
    assert (err.param, str(err)) == ("logprobs", str(rule.value))


def parse_error(model, body) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(model, json.dumps(body).encode())
    return info.value


@pytest.mark.parametrize(
    "sampling_params, param",
    [({"top_p": 0}, "sampling_params.top_p"), ({"max_new_tokens": 0}, "sampling_params.max_new_tokens"),
     ({"min_new_tokens": 5, "max_new_tokens": 3}, "sampling_params.min_new_tokens"),
     ({"stop": ["x"] * 17}, "sampling_params.stop")],
)  # fmt: skip
def test_native_errors_name_the_native_field(sampling_params, param):
    err = parse_error(GenerateRequest, {"text": "hi", "sampling_params": sampling_params})
    assert err.param == param and f"'{param}'" in str(err)


def test_parsing_yields_the_validated_sampling_object():
    req = chat(temperature=0, stop=["a", ""], n=2, max_tokens=5, include_stop_str_in_output=True)
    sampling, explicit = req.sampling(100)
    assert explicit and sampling.stop == ["a"] and sampling.n == 2 and sampling.include_stop_str_in_output
    assert req.stop_list() == ["a"]  # the empty stop string stops nothing, here and offline
    assert SamplingParams(stop=["a", ""]).stop == ["a"]
    assert chat(min_tokens=7).sampling(3)[0].max_tokens == 7  # an unset max_tokens never goes under min_tokens
