"""Offline API, vLLM-shaped: `LLM(model, **config).generate(prompts, SamplingParams(...))`.

It runs the server's request path in-process, with the same objects: the tokenizer stage's
`RequestTokenizer` (chat template with its fallback and tools, validation, context and KV pool fit), the
real `Scheduler`, and the detokenizer's `IncrementalDetokenizer` (stop strings, incremental
text, logprob texts, echo). A stop string ends its request by an abort straight to the
scheduler, as the detokenizer process does. `n` fans out like the server (`core.fan_out`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

from tqdm import tqdm

from minisgl.core import SamplingParams, fan_out
from minisgl.engine.config import EngineConfig
from minisgl.platform.kernel_config import KernelConfig
from minisgl.llm.embed import EmbeddingRequestOutput, embed_inputs, embed_prompts
from minisgl.llm.outputs import OutputBuilder, RequestOutput
from minisgl.message.tokenizer import ChatPrompt, Prompt, TextPrompt, TokenizeMsg, TokenOut, TokenPrompt
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.build import build_scheduler, engine_limits
from minisgl.tokenizer.detokenizer import make_decoders
from minisgl.tokenizer.incremental import IncrementalDetokenizer
from minisgl.tokenizer.reasoning import reasoning_parser_class
from minisgl.tokenizer.request import RequestTokenizer, load_hf_tokenizer

PromptInput = str | list[int]
Message = dict[str, Any]
ParamsInput = SamplingParams | Sequence[SamplingParams] | None
LoraInput = str | Sequence[str | None] | None  # a LoRA adapter's name for every prompt, or one per prompt

_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig))
_SCHED_FIELDS = frozenset(f.name for f in fields(SchedulerConfig))
_KERNEL_FIELDS = frozenset(f.name for f in fields(KernelConfig))  # LLM(pdl=False) == kernels=KernelConfig(pdl=False)


def split_config(
    model: str | None, kwargs: dict[str, Any], engine_config: EngineConfig | None = None,
    scheduler_config: SchedulerConfig | None = None,
) -> tuple[EngineConfig, SchedulerConfig]:  # fmt: skip
    """`LLM(...)` keywords onto the two configs by field name (a name both have goes to both);
    an unknown name is a TypeError listing the valid ones."""
    unknown = sorted(set(kwargs) - _ENGINE_FIELDS - _SCHED_FIELDS - _KERNEL_FIELDS - {"tp_rank"})
    if unknown or "tp_rank" in kwargs:
        valid = ", ".join(sorted((_ENGINE_FIELDS | _SCHED_FIELDS | _KERNEL_FIELDS | {"engine_config", "scheduler_config"})
                                 - {"tp_rank"}))
        raise TypeError(f"LLM() got unexpected keyword argument(s) {', '.join(unknown or ['tp_rank'])}; "
                        f"valid: model, {valid}")  # fmt: skip
    engine_kw = {k: v for k, v in kwargs.items() if k in _ENGINE_FIELDS}
    sched_kw = {k: v for k, v in kwargs.items() if k in _SCHED_FIELDS}
    if model is not None:
        engine_kw["model"] = model
    if scheduler_config is None:
        sched_kw.setdefault("max_prefill_tokens", None)  # None: the platform's offline default
    engine = replace(engine_config or EngineConfig(), **engine_kw)
    kernel_kw = {k: v for k, v in kwargs.items() if k in _KERNEL_FIELDS}
    if kernel_kw:
        engine = replace(engine, kernels=replace(engine.kernels, **kernel_kw))
    sched = replace(scheduler_config or SchedulerConfig(), **sched_kw)
    return engine, sched


class _NoTokenizer:
    """Checkpoints built for tests may carry no tokenizer; then only token ids go in."""

    chat_template = None

    def __init__(self, model_dir: object) -> None:
        self.model_dir = model_dir

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise ValueError(f"{self.model_dir} has no tokenizer: pass token ids instead of text")

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        raise ValueError(f"{self.model_dir} has no tokenizer: pass token ids instead of messages")

    def decode(self, ids: list[int]) -> str:
        return ""


def _no_token_text(token_id: int) -> tuple[str, bytes]:
    return "", b""


class LLM:
    """`LLM(model=None, **config)`: every `EngineConfig` / `SchedulerConfig` field is a keyword
    (`device`, `dtype`, `page_size`, `num_pages`, `max_running_requests`, `cache`, ...);
    `engine_config=` / `scheduler_config=` give whole configs that the keywords then override.
    `reasoning_parser` (qwen3, deepseek_r1, gpt_oss): `chat` outputs carry the thinking in
    `reasoning_content`, apart from `text` (docs/reasoning.md). LoRA: `lora_modules={name: path}`
    (or pairs), `max_loras`, `max_lora_rank`, `enable_lora`; `generate(..., lora=name)` runs a
    prompt on an adapter (lora/)."""

    def __init__(
        self, model: str | None = None, *, engine_config: EngineConfig | None = None,
        scheduler_config: SchedulerConfig | None = None, reasoning_parser: str | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        if reasoning_parser is not None:
            reasoning_parser_class(reasoning_parser)  # an unknown name: ValueError before the model loads
        self.reasoning_parser = reasoning_parser
        if isinstance(kwargs.get("lora_modules"), dict):
            kwargs["lora_modules"] = tuple(kwargs["lora_modules"].items())
        elif "lora_modules" in kwargs:
            kwargs["lora_modules"] = tuple(tuple(pair) for pair in kwargs["lora_modules"])
        engine_cfg, sched_cfg = split_config(model, kwargs, engine_config, scheduler_config)
        self.engine, self.scheduler = build_scheduler(engine_cfg, sched_cfg)
        self._tokenizer: Any = None
        self._requests: RequestTokenizer | None = None
        if self.has_tokenizer:
            self.detok = IncrementalDetokenizer(*make_decoders(str(self.engine.model_dir)))
        else:  # token ids only: no per-step decoding
            self.detok = IncrementalDetokenizer(None, _no_token_text)
        self._next_rid = 0

    @property
    def has_tokenizer(self) -> bool:
        model_dir = self.engine.model_dir
        return any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            model_dir = self.engine.model_dir
            self._tokenizer = load_hf_tokenizer(str(model_dir)) if self.has_tokenizer else _NoTokenizer(model_dir)
        return self._tokenizer

    @property
    def requests(self) -> RequestTokenizer:
        """The tokenizer stage's request logic (the same class the tokenizer process runs)."""
        if self._requests is None:
            self._requests = RequestTokenizer(self.tokenizer, engine_limits(self.scheduler), self.reasoning_parser)
        return self._requests

    def encode(self, prompt: PromptInput) -> list[int]:
        return self.requests.encode(TokenPrompt(list(prompt)) if not isinstance(prompt, str) else TextPrompt(prompt))

    def apply_chat_template(self, messages: list[Message], tools: list[dict[str, Any]] | None = None,
                            **template_kwargs: Any) -> list[int]:  # fmt: skip
        """The prompt ids the server would run for these chat messages."""
        return self.requests.encode(ChatPrompt(list(messages), list(tools or []), dict(template_kwargs)))

    def generate(self, prompts: PromptInput | Sequence[PromptInput], sampling_params: ParamsInput = None,
                 use_tqdm: bool = True, lora: LoraInput = None) -> list[RequestOutput]:  # fmt: skip
        """One `RequestOutput` per prompt (a string, or token ids), in order; `lora`: the adapter
        (by name) of every prompt, or a list with one per prompt (None: the base model)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int))
        items: list[Any] = [prompts] if single else list(prompts)
        wrapped: list[Prompt] = [TextPrompt(p) if isinstance(p, str) else TokenPrompt([int(t) for t in p]) for p in items]
        return self._run(wrapped, sampling_params, use_tqdm, lora)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter at run time (ValueError: LoRA off, name taken, bad adapter)."""
        self.scheduler.load_adapter(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        self.scheduler.unload_adapter(name)

    def chat(
        self, messages: list[Message] | Sequence[list[Message]], sampling_params: ParamsInput = None,
        use_tqdm: bool = True, chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None, lora: LoraInput = None,
    ) -> list[RequestOutput]:  # fmt: skip
        """One conversation (a list of OpenAI messages) or many; `tools`: OpenAI function tools;
        `lora` as in `generate`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = dict(chat_template_kwargs or {})
        prompts: list[Prompt] = [ChatPrompt(list(c), list(tools or []), kwargs) for c in conversations]  # type: ignore[arg-type]
        return self._run(prompts, sampling_params, use_tqdm, lora)

    def embed(self, prompts: PromptInput | Sequence[PromptInput], *, dimensions: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:  # fmt: skip
        """One embedding per prompt (an embedding model, or `LLM(task="embed")`); vLLM-shaped:
        `outputs.embedding`. `dimensions`: a Matryoshka model's shorter vector (llm/embed.py)."""
        wrapped = embed_inputs(prompts)
        first, self._next_rid = self._next_rid, self._next_rid + len(wrapped)
        return embed_prompts(self.scheduler, self.requests, wrapped, first, dimensions, use_tqdm)

    def _run(self, prompts: list[Prompt], sampling_params: ParamsInput, use_tqdm: bool,
             lora: LoraInput = None) -> list[RequestOutput]:  # fmt: skip
        """Validate and queue the prompts, step the scheduler until all finish, detokenizing each
        step's outputs as they come.

        Prompts are tokenized, checked and queued a slice at a time: the first step starts once
        twice its token budget is waiting, and the rest go in between steps while the device
        runs (encoding and checking 256 prompts of ~560 tokens takes ~15 ms of host time, which
        otherwise all came before the first launch). The waiting queue never runs short of a
        step's budget, so the scheduler sees the same order as with everything queued at once. A
        prompt that fails its check raises (ValueError, the server's message) after the requests
        queued so far are aborted."""
        params = _params_per_prompt(sampling_params, len(prompts))
        adapters = _lora_per_prompt(lora, len(prompts))
        results: list[RequestOutput] = []
        builders: dict[int, OutputBuilder] = {}
        queued = 0
        slice_tokens = 2 * self.scheduler.prefill_budget
        total = sum(sp.n for sp in params)
        bar = tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm)

        def queue_more() -> None:
            nonlocal queued
            tokens = 0
            while queued < len(prompts) and tokens < slice_tokens:
                tokens += self._queue(prompts[queued], params[queued], results, builders, adapters[queued])
                queued += 1

        pending = total
        abort_outs: list[TokenOut] = []
        try:
            queue_more()
            while pending:
                outputs: list[Any] = self.scheduler.step()
                queue_more()
                result = self.detok.process(abort_outs + outputs if abort_outs else outputs)
                abort_outs = []
                for rid in result.aborts:  # stop strings: straight to the scheduler
                    if self.scheduler.abort(rid):
                        abort_outs.append(TokenOut(rid, [], "abort"))
                for delta in result.deltas:
                    builder = builders[delta.rid]
                    builder.add(delta)
                    if builder.finished:
                        pending -= 1
                        bar.update(1)
            if abort_outs:
                self.detok.process(abort_outs)
        except BaseException:
            for rid, builder in builders.items():
                if not builder.finished:
                    self.scheduler.abort(rid)
                self.detok.states.pop(rid, None)
                self.detok.stopped.pop(rid, None)
            raise
        finally:
            bar.close()
        for request in results:
            first = builders[int(request.request_id)]
            request.num_cached_tokens = first.cached_tokens
            request.prompt_logprobs = first.prompt_logprobs
        return results

    def _queue(self, prompt: Prompt, sampling: SamplingParams, results: list[RequestOutput],
               builders: dict[int, OutputBuilder], lora: str | None = None) -> int:  # fmt: skip
        """Tokenize, check and queue the `sampling.n` requests of one prompt; its token count."""
        want_logprobs = sampling.logprobs is not None
        echo = sampling.prompt_logprobs is not None  # the detokenizer gives their texts with the echo
        outputs = []
        ids: list[int] = []
        text: str | None = None
        for index, choice in enumerate(fan_out(sampling)):
            rid = self._next_rid
            self._next_rid += 1
            msg = TokenizeMsg(rid, prompt, choice, False, list(sampling.stop),
                              include_stop=sampling.include_stop_str_in_output, echo=echo)  # fmt: skip
            tokenized = self.requests.tokenize(msg)
            ids, text = tokenized.msg.input_ids, tokenized.prompt_text
            self.scheduler.add_request(rid, ids, tokenized.msg.sampling, lora=lora)
            assert tokenized.msg.facts is not None
            self.detok.register(tokenized.msg.facts)
            builders[rid] = builder = OutputBuilder(index, want_logprobs)
            outputs.append(builder.out)
        results.append(RequestOutput(str(self._next_rid - sampling.n), text, ids, outputs))
        return len(ids) * sampling.n


def _lora_per_prompt(lora: LoraInput, count: int) -> list[str | None]:
    if lora is None or isinstance(lora, str):
        return [lora] * count
    names = list(lora)
    if len(names) != count:
        raise ValueError(f"{count} prompts but {len(names)} LoRA adapter names")
    return names


def _params_per_prompt(sampling_params: ParamsInput, count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"{count} prompts but {len(params)} sampling params")
    return params
