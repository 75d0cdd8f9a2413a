"""Structured output on the embedded SmolLM2 (xgrammar): JSON schemas, any JSON object and regular
expressions, batched with each other and with an unconstrained request, with and without overlap
scheduling (where constrained requests decode every other step)."""

from __future__ import annotations

import json
import re

import pytest

from minisgl import LLM, SamplingParams
from minisgl.scheduler.config import SchedulerConfig

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS: list[tuple[str, dict]] = [
    ("Give me a person as JSON.", {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }),
    ("Describe a European capital as JSON.", {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        },
        "required": ["city", "population"],
    }),
    ("List a few prime numbers as JSON.", {
        "type": "object",
        "properties": {"primes": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 5}},
        "required": ["primes"],
    }),
    ("Rate this answer as JSON.", {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
        "required": ["ok", "score"],
    }),
    ("Describe a country as JSON.", {
        "type": "object",
        "properties": {
            "country": {"type": "string", "maxLength": 16},
            "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
        },
        "required": ["country", "continent"],
    }),
    ("Give two points as JSON.", {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "integer", "maximum": 999}, "y": {"type": "integer", "maximum": 999}},
            "required": ["x", "y"],
        },
        "minItems": 2,
        "maxItems": 2,
    }),
]
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
EMAIL = r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"


@pytest.fixture(scope="module")
def llms() -> dict[bool, LLM]:
    return {}


def _llm(llms: dict[bool, LLM], overlap: bool) -> LLM:
    if overlap not in llms:
        llms[overlap] = LLM(device="cpu", scheduler_config=SchedulerConfig(overlap=overlap))
    return llms[overlap]


def _chat(llm: LLM, question: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": question}])


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_batch(llms, overlap) -> None:
    llm = _llm(llms, overlap)
    prompts = [_chat(llm, q) for q, _ in SCHEMAS]
    params = [SamplingParams(temperature=0, max_tokens=64, json_schema=json.dumps(s)) for _, s in SCHEMAS]
    prompts.append(_chat(llm, 'Reply with a JSON object with the key "answer": what is 2 + 2?'))
    params.append(SamplingParams(temperature=0, max_tokens=48, json_object=True))
    prompts.append(_chat(llm, "What is a phone number?"))
    params.append(SamplingParams(temperature=0, max_tokens=24, regex=PHONE))
    prompts.append(_chat(llm, "Write an email address."))
    params.append(SamplingParams(temperature=0.8, seed=3, max_tokens=24, regex=EMAIL))
    plain_prompt = _chat(llm, "What is the capital of France?")
    prompts.append(plain_prompt)
    params.append(SamplingParams(temperature=0, max_tokens=12))

    results = llm.generate(prompts, params, use_tqdm=False)
    for (_, schema), res in zip(SCHEMAS, results):
        assert res.outputs[0].finish_reason == "stop", res.outputs[0].text
        jsonschema.validate(json.loads(res.outputs[0].text), schema)
    obj = results[len(SCHEMAS)]
    assert obj.outputs[0].finish_reason == "stop" and isinstance(json.loads(obj.outputs[0].text), dict)
    for res, pattern in zip(results[len(SCHEMAS) + 1 : len(SCHEMAS) + 3], (PHONE, EMAIL)):
        assert res.outputs[0].finish_reason == "stop"
        assert re.fullmatch(pattern, res.outputs[0].text), res.outputs[0].text
    # The unconstrained request is untouched by its constrained neighbours.
    alone = llm.generate([plain_prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert results[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    llm.scheduler.check_idle_invariants()


def test_invalid_constraints_are_rejected(llms) -> None:
    llm = _llm(llms, False)
    for bad in (SamplingParams(json_schema="{not json"), SamplingParams(regex="(unclosed")):
        with pytest.raises(ValueError):
            llm.scheduler.add_request(10_000, [1, 2, 3], bad)
    assert not llm.scheduler.has_work()
