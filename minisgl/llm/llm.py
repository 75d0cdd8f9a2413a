"""Offline API: `LLM(...).generate(prompts, sampling_params)` through the real scheduler."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence, Union

from tqdm import tqdm

from minisgl.core import SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler

Prompt = Union[str, list[int]]
Message = dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        page_size: int = 16,
        num_pages: int | None = None,
        dummy_weights: bool = False,
        attn: str | None = None,
        max_running_requests: int = 256,
        max_prefill_tokens: int | None = None,  # None: the platform's offline default
        cache: str = "radix",
        max_model_len: int | None = None,
        cuda_graph_max_bs: int = 256,
        seed: int = 0,
        engine_config: EngineConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
    ) -> None:
        engine_config = engine_config or EngineConfig(
            model=model, device=device, dtype=dtype, page_size=page_size,  # type: ignore[arg-type]
            num_pages=num_pages, dummy_weights=dummy_weights, attn=attn,
            max_model_len=max_model_len, cuda_graph_max_bs=cuda_graph_max_bs, seed=seed,
        )
        sched_config = scheduler_config or SchedulerConfig(
            max_running_requests=max_running_requests, max_prefill_tokens=max_prefill_tokens, cache=cache  # type: ignore[arg-type]
        )
        engine_config = replace(engine_config, max_running_requests=sched_config.max_running_requests)
        self.engine = Engine(engine_config)
        self.scheduler = Scheduler(self.engine, sched_config)
        self._tokenizer: Any = None
        self._next_rid = 0

    @property
    def has_tokenizer(self) -> bool:
        """Checkpoints built for tests may carry no tokenizer; then only token ids go in and out."""
        model_dir = self.engine.model_dir
        return any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if not self.has_tokenizer:
                raise ValueError(f"{self.engine.model_dir} has no tokenizer: pass token ids instead of text")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.engine.model_dir))
        return self._tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(map(int, prompt))

    def apply_chat_template(self, messages: list[Message], **template_kwargs: Any) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **template_kwargs
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        return self._run(list(prompts), sampling_params, use_tqdm)  # type: ignore[arg-type]

    def chat(
        self,
        conversations: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        kwargs = chat_template_kwargs or {}
        return self._run(list(conversations), sampling_params, use_tqdm,
                         lambda conversation: self.apply_chat_template(conversation, **kwargs))  # fmt: skip

    def _run(
        self,
        prompts: list[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        encode: Callable[[Any], list[int]] | None = None,
    ) -> list[dict[str, Any]]:
        """Queue the prompts (turned into token ids by `encode`, default `self.encode`) and step
        the scheduler until all finish.

        Prompts are encoded, checked and queued a slice at a time: the first step starts once
        twice its token budget is waiting, and the rest go in between steps while the device
        runs (encoding and checking 256 prompts of ~560 tokens takes ~15 ms of host time, which
        otherwise all came before the first launch). The waiting queue never runs short of a
        step's budget, so the scheduler sees the same order as with everything queued at once. A
        prompt that fails its check raises after the requests queued so far are aborted."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        encode = encode or self.encode
        first_rid = self._next_rid
        self._next_rid += len(prompts)
        results: dict[int, dict[str, Any]] = {}
        queued = 0
        slice_tokens = 2 * self.scheduler.prefill_budget

        def queue_more() -> None:
            nonlocal queued
            tokens = 0
            while queued < len(prompts) and tokens < slice_tokens:
                ids, sp, rid = encode(prompts[queued]), params[queued], first_rid + queued
                self.scheduler.add_request(rid, ids, sp)
                results[rid] = {
                    "token_ids": [], "finish_reason": None, "prompt_tokens": len(ids), "cached_tokens": 0,
                    "logprobs": [] if sp.logprobs is not None else None, "prompt_logprobs": None,
                }
                queued += 1
                tokens += len(ids)

        bar = tqdm(total=len(prompts), desc="Generating", unit="req", disable=not use_tqdm)
        pending = len(prompts)
        try:
            queue_more()
            while pending:
                outputs = self.scheduler.step()
                queue_more()
                for out in outputs:
                    result = results.get(out.rid)
                    if result is None:
                        continue
                    result["token_ids"].extend(out.token_ids)
                    result["cached_tokens"] = out.cached_tokens
                    if out.logprobs is not None:
                        result["logprobs"].extend(out.logprobs)
                    if out.prompt_logprobs is not None:
                        result["prompt_logprobs"] = out.prompt_logprobs
                    if out.finish_reason is not None:
                        result["finish_reason"] = out.finish_reason
                        pending -= 1
                        bar.update(1)
        except BaseException:
            for rid, result in results.items():
                if result["finish_reason"] is None:
                    self.scheduler.abort(rid)
            raise
        finally:
            bar.close()
        ordered = []
        for rid in range(first_rid, first_rid + len(prompts)):
            result = results[rid]
            result["text"] = (
                self.tokenizer.decode(result["token_ids"], skip_special_tokens=True) if self.has_tokenizer else None
            )
            ordered.append(result)
        return ordered
