"""Offline API: `LLM(...).generate(prompts, sampling_params)` through the real scheduler."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence, Union

from tqdm import tqdm

from minisgl.core import SamplingParams
from minisgl.engine.config import EngineConfig
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
        self.scheduler = Scheduler(engine_config, sched_config)
        self.engine = self.scheduler.engine
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
        return self._run([self.encode(p) for p in prompts], sampling_params, use_tqdm)  # type: ignore[arg-type]

    def chat(
        self,
        conversations: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        ids = [self.apply_chat_template(c, **(chat_template_kwargs or {})) for c in conversations]  # type: ignore[arg-type]
        return self._run(ids, sampling_params, use_tqdm)

    def _run(
        self,
        prompt_ids: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[dict[str, Any]]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_ids)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_ids):
                raise ValueError(f"{len(prompt_ids)} prompts but {len(params)} sampling params")
        rids: list[int] = []
        for ids, sp in zip(prompt_ids, params):
            rid = self._next_rid
            self._next_rid += 1
            self.scheduler.add_request(rid, ids, sp)
            rids.append(rid)
        results: dict[int, dict[str, Any]] = {
            rid: {
                "token_ids": [], "finish_reason": None, "prompt_tokens": len(ids), "cached_tokens": 0,
                "logprobs": [] if sp.logprobs is not None else None, "prompt_logprobs": None,
            }
            for rid, ids, sp in zip(rids, prompt_ids, params)
        }
        bar = tqdm(total=len(rids), desc="Generating", unit="req", disable=not use_tqdm)
        pending = len(rids)
        while pending:
            for out in self.scheduler.step():
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
        bar.close()
        ordered = []
        for rid in rids:
            result = results[rid]
            result["text"] = (
                self.tokenizer.decode(result["token_ids"], skip_special_tokens=True) if self.has_tokenizer else None
            )
            ordered.append(result)
        return ordered
