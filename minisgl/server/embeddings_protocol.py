"""The OpenAI `POST /v1/embeddings` body, validated strictly, and the reply it gets.

`input`: a string, a list of strings, a list of token ids, or a list of token-id lists (at most
`MAX_INPUTS` inputs, none empty). `encoding_format`: "float" (JSON numbers) or "base64" (the
float32 little-endian bytes, base64-encoded: what the openai SDK asks for and decodes).
`dimensions`: checked by the scheduler against the model (Matryoshka or not: models/pooling.py).
"""

from __future__ import annotations

import base64
from array import array
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidatorFunctionWrapHandler, field_validator

from minisgl.message.frontend import EmbeddingOut
from minisgl.message.tokenizer import Prompt, TextPrompt, TokenPrompt
from minisgl.server.protocol import RequestError, _Strict

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Strict):
    input: EmbeddingInput = Field(description=f"A string, a list of strings, a list of token ids, or a list of "
                                  f"token-id lists (at most {MAX_INPUTS} inputs, none empty).")  # fmt: skip
    model: str | None = None
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="'float': JSON numbers; 'base64': the float32 little-endian bytes, base64-encoded.")
    dimensions: int | None = Field(
        None, description="A shorter vector (Matryoshka models only): the first values, renormalized.")
    user: str | None = None  # harmless: accepted, no effect

    @field_validator("input", mode="wrap")
    @classmethod
    def _inputs(cls, raw: Any, handler: ValidatorFunctionWrapHandler) -> EmbeddingInput:
        try:
            value: EmbeddingInput = handler(raw)
        except ValidationError:
            raise RequestError("'input' must be a string, a list of strings, a list of token ids or a list of "
                               "token-id lists", "input") from None  # fmt: skip
        items = [value] if isinstance(value, str) else value
        if not items:
            raise RequestError("'input' must not be empty", "input")
        if len(items) > MAX_INPUTS and not isinstance(items[0], int):
            raise RequestError(f"'input' holds {len(items)} inputs; at most {MAX_INPUTS} are allowed", "input")
        if any(isinstance(item, (str, list)) and not item for item in items):
            raise RequestError("'input' must not contain an empty string or an empty token list", "input")
        return value

    @field_validator("dimensions")
    @classmethod
    def _dimensions(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise RequestError(f"'dimensions' must be at least 1, got {value}", "dimensions")
        return value

    def prompts(self) -> list[Prompt]:
        value = self.input
        if isinstance(value, str):
            return [TextPrompt(value)]
        if isinstance(value[0], int):
            return [TokenPrompt(list(value))]  # type: ignore[arg-type]
        return [TextPrompt(item) if isinstance(item, str) else TokenPrompt(list(item)) for item in value]


def embedding_data(outs: list[EmbeddingOut], encoding_format: str) -> list[dict[str, Any]]:
    """The `data` entries of the reply, in input order."""
    data = []
    for index, out in enumerate(outs):
        if encoding_format == "base64":
            value: Any = base64.b64encode(out.embedding).decode("ascii")
        else:
            floats = array("f")
            floats.frombytes(out.embedding)
            value = floats.tolist()
        data.append({"object": "embedding", "index": index, "embedding": value})
    return data


def embedding_response(outs: list[EmbeddingOut], model: str, encoding_format: str) -> dict[str, Any]:
    prompt_tokens = sum(out.prompt_tokens for out in outs)
    return {"object": "list", "data": embedding_data(outs, encoding_format), "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}  # fmt: skip
