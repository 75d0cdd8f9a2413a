"""Validated OpenAI bodies -> the `TokenizeMsg`s of their requests, for every front end that
speaks them (the HTTP routes and `--shell`): one request per choice (`core.fan_out`), and per
prompt for completions."""

from __future__ import annotations

from minisgl.core import SamplingParams, fan_out
from minisgl.message.tokenizer import ChatPrompt, Prompt, TokenizeMsg
from minisgl.server.chat_protocol import ChatCompletionRequest
from minisgl.server.choice import ChoiceOptions
from minisgl.server.protocol import CompletionRequest


def chat_prompt(req: ChatCompletionRequest) -> ChatPrompt:
    return ChatPrompt(req.messages, req.prompt_tools(), dict(req.chat_template_kwargs or {}))


def chat_options(req: ChatCompletionRequest) -> ChoiceOptions:
    """How a chat body's replies are split into text and tool calls (and whether they carry logprobs)."""
    return ChoiceOptions(tool_mode=req.tool_mode, tool_names=tuple(req.tool_names), forced_tool=req.forced_tool,
                         parallel_tools=req.parallel_tool_calls is not False, logprobs=bool(req.logprobs))  # fmt: skip


def chat_msgs(req: ChatCompletionRequest, rids: list[int], sampling: SamplingParams, explicit: bool) -> list[TokenizeMsg]:
    """The `req.n` requests of a chat body (`sampling`, `explicit`: from `req.sampling`)."""
    prompt = chat_prompt(req)
    return [TokenizeMsg(rid, prompt, choice, explicit, req.stop_list(), include_stop=req.include_stop_str_in_output)
            for rid, choice in zip(rids, fan_out(sampling, req.n))]  # fmt: skip


def completion_msgs(req: CompletionRequest, prompts: list[Prompt], rids: list[int], sampling: SamplingParams,
                    explicit: bool) -> list[TokenizeMsg]:  # fmt: skip
    """`req.n` requests per prompt, prompt-major (choice i of prompt p is rid p * n + i)."""
    choices = fan_out(sampling, req.n)
    return [TokenizeMsg(rid, prompts[i // req.n], choices[i % req.n], explicit, req.stop_list(),
                        include_stop=req.include_stop_str_in_output, echo=req.echo)
            for i, rid in enumerate(rids)]  # fmt: skip
