"""The model runner: owns the model, the KV pool, the token table, attention and sampling.

The scheduler hands it a `StepPlan` (host lists); it builds the device batch, runs the model
inside `forward_context`, and samples the next token of every request that completed its input.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.batch import ForwardBatch
from minisgl.attention.registry import ATTN_BACKENDS
from minisgl.core import Req, SamplingParams
from minisgl.engine.graph import Runner, graph_capacity, padded_rows
from minisgl.distributed import TPInfo, get_tp_info, set_tp_info
from minisgl.engine.config import EngineConfig
from minisgl.engine.resolve import resolve
from minisgl.engine.grammar import GrammarState, bitmask_width
from minisgl.engine.penalties import PenaltyTracker
from minisgl.engine.pooling import PooledRows
from minisgl.engine.speculative import row_steps, verify_row
from minisgl.engine.sampler import LogitsControls, Sampler, SamplingBatch, token_logprobs
from minisgl.engine.step import ForwardOut, LaunchedStep, PromptChunk, StepPlan, chunked_logprobs, host_copy
from minisgl.utils.transfer import StagingRing, stacked, upload, upload_many
from minisgl.kvcache.latent_pool import LatentPool
from minisgl.kvcache.pool import KVPool, resolve_kv_dtype
from minisgl.layers.attention import AttentionLayer
from minisgl.layers.rotary import long_rope_rows
from minisgl.models.config import ModelConfig
from minisgl.models.pooling import resolve_task
from minisgl.platform import init_platform
from minisgl.utils.logging import get_logger

if TYPE_CHECKING:
    from minisgl.lora.manager import LoraManager

logger = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        from minisgl.models.gguf_weights import load_gguf_weights
        from minisgl.models.loader import init_dummy_weights
        from minisgl.models.quant_fp8 import load_checkpoint, quantize_loaded
        from minisgl.models.registry import build_model
        from minisgl.models.source import gguf_file, resolve_model_dir

        self.platform = init_platform(config.device)
        # Every `auto` choice made once; the layers built below read the kernel choices.
        self.config = config = resolve(config, self.platform)
        self.platform.use_kernels(config.kernels)
        self.platform.set_device()
        self.device = self.platform.device
        set_tp_info(TPInfo(config.tp_rank, config.tp_size))
        self.model_dir: Path = resolve_model_dir(config.model, float_weights=config.weights != "gguf")
        self.model_config = ModelConfig.from_dir(self.model_dir)
        # Embeddings (models/pooling.py): the model runs without its LM head, and never decodes.
        self.task, self.pooler = resolve_task(config.task, self.model_dir, self.model_config)
        if self.task == "embed":
            self.model_config = replace(self.model_config, has_lm_head=False)
        self.dtype = _DTYPES[config.dtype]
        self.context_len = self.model_config.serving_context_len(config.max_model_len)
        if self.context_len < self.model_config.context_len:
            logger.info("serving a context of %d tokens (model: %d)", self.context_len, self.model_config.context_len)

        sample_kernels = None  # the C++ CPU sampler's library, where this engine runs the C++ kernels
        if config.kernels.cpu_kernels:
            from minisgl.kernels import cpu_ops

            # Per engine (the choice is process-wide): fp32 norms/rotary/SiLU take the C++ kernels
            # for GGUF blocks kept quantized, the references in the exact fp32 mode.
            fp32_kernels = bool(config.kernels.cpu_kernels_fp32) and self.dtype == torch.float32
            cpu_ops.set_fp32(fp32_kernels)
            if self.dtype == torch.bfloat16 or fp32_kernels:
                # Built (or loaded from the extension cache) before the layers pick their kernels.
                start = time.perf_counter()
                if cpu_ops.enabled():
                    logger.info("%s CPU kernels ready in %.1f s", "fp32" if fp32_kernels else "bf16",
                                time.perf_counter() - start)
                    sample_kernels = cpu_ops.load()  # (cpu_kernels is resolved off away from the CPU)
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = build_model(self.model_config)
        finally:
            torch.set_default_dtype(default_dtype)
        kv_scales: dict[int, tuple[float, float]] = {}
        if config.dummy_weights:
            init_dummy_weights(self.model, config.seed)
        elif config.weights == "gguf":  # the GGUF's blocks kept as they are (models/gguf_weights.py)
            load_gguf_weights(self.model, gguf_file(config.model))
        else:
            kv_scales = load_checkpoint(self.model, self.model_dir)  # float8 layers where the checkpoint has them
        if config.quantization != "auto":  # a float model's linear layers to float8 (models/quant_fp8.py)
            quantize_loaded(self.model, block=(128, 128) if config.quantization == "fp8_block" else None)
        self.model.eval()
        self.lora = self._make_lora()  # None: no adapters served

        self.pool = self._make_pool()
        # Row `max_running_requests` is a scratch row used by padded (graph) batch entries.
        self.token_table = torch.zeros(
            config.max_running_requests + 1, self.context_len, dtype=torch.int32, device=self.device
        )
        assert config.attn is not None
        attn_name = config.attn
        num_heads, num_kv_heads = self.attn_shape
        self.attn_backend = ATTN_BACKENDS.get(attn_name)(
            self.pool, num_heads, num_kv_heads, self.model_config.head_dim, self.model_config.softmax_scale
        )
        self.attn_name = attn_name
        for module in self.model.modules():
            if isinstance(module, AttentionLayer):  # each layer tells the backend its window / soft-cap
                module.bind(self.attn_backend)
        self.sampler = Sampler(fused=config.kernels.fused_kernels, seed=config.seed, cpu_kernels=sample_kernels)
        self.penalties = PenaltyTracker(self.model_config.vocab_size, self.device)
        # Reused host staging and events (allocating pinned memory or CUDA events per step costs
        # more than the step's own host work). Two of each: step N+1 is built while step N's
        # copies may still be in flight, and step N is always complete before N+2 is built.
        self._staging = StagingRing(self.platform.pin_memory)
        self._token_staging = StagingRing(self.platform.pin_memory)
        self._events = [self.platform.new_event(), self.platform.new_event()]
        self._step_parity = 0
        self._no_targets = torch.empty(0, dtype=torch.int64, device=self.device)
        self.pad_eager = bool(config.pad_eager)
        if self.pool.quantized:  # before folding (it runs the plain layers) and graph capture
            self._set_kv_scales(kv_scales)
        # Fewer kernels per layer where the Triton kernels finish the RMSNorms (models/llama.py).
        fold = getattr(self.model, "fold_norms", None)
        # Over a float8 pool too: the rotary kernel's own KV store scales and saturates.
        if config.kernels.fold_norms and fold is not None and fold():
            logger.info("RMSNorm weights folded into the qkv and gate_up projections")
        self.runner = self._make_runner()
        # Compiled kernels only (the CPU interpreter compiles nothing); MLA layers run their own.
        if self.platform.compiles_triton and not isinstance(self.pool, LatentPool):
            self.attn_backend.warmup(self.token_table, self.scratch_row)
        logger.info(
            "engine ready: %s on %s (%s), %d KV pages of %d tokens, attention %s",
            self.model_config.architecture, self.device, str(self.dtype).replace("torch.", ""),
            self.pool.num_pages, self.pool.page_size, attn_name,
        )

    @property
    def attn_shape(self) -> tuple[int, int]:
        """This rank's query and KV head counts."""
        tp = get_tp_info()
        return self.model_config.num_heads // tp.size, max(1, self.model_config.num_kv_heads // tp.size)

    def _set_kv_scales(self, from_checkpoint: dict[int, tuple[float, float]]) -> None:
        """A float8 pool's per-layer scales: the checkpoint's, else measured (engine/kv_scales.py)
        unless `calculate_kv_scales` is off (then 1.0)."""
        source = "scales 1.0"
        if from_checkpoint:
            self.pool.set_scales(from_checkpoint)
            source = f"the checkpoint's scales ({len(from_checkpoint)} layers)"
        elif self.config.calculate_kv_scales:
            from minisgl.engine.kv_scales import calibrate

            source = calibrate(self, lambda req, slots: self.build_batch(StepPlan([req], slots))[0])
        logger.info("KV cache in %s with %s", self.config.kv_cache_dtype, source)

    def _make_lora(self) -> LoraManager | None:
        """The adapter slots in every projection, and the adapters named at start (lora/)."""
        if not self.config.lora:
            return None
        from minisgl.lora.manager import LoraManager
        from minisgl.models.loader import target_of

        cfg, model = self.config, self.model
        manager = LoraManager(model, lambda name: target_of(model, name), cfg.max_loras, cfg.max_lora_rank,
                              use_triton=self.platform.compiles_triton)  # fmt: skip
        for name, path in cfg.lora_modules:
            manager.load(name, path)
        return manager

    def _cpu_half_dtype(self) -> torch.dtype:
        """16-bit page type of "auto" for GGUF weights on CPU: fp16, or bf16 where the CPU kernels
        run their portable path (no hardware fp16 conversion there)."""
        if self.device.type != "cpu":
            return torch.float16
        from minisgl.kernels import cpu_attention

        lib = cpu_attention.load()
        return torch.bfloat16 if lib is not None and lib.resolve() == "portable" else torch.float16

    # ----------------------------------------------------------------------------------------
    def _make_pool(self) -> KVPool:
        cfg, mc = self.config, self.model_config
        tp = get_tp_info()
        kv_heads = max(1, mc.num_kv_heads // tp.size)
        mla = mc.deepseek  # MLA caches one latent per token and layer (kvcache/latent_pool.py)
        assert cfg.attn is not None
        kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype, cfg.weights == "gguf", cfg.attn, mla is not None,
                                    half=self._cpu_half_dtype())  # fmt: skip
        if kv_dtype != torch.float8_e4m3fn:  # float8's line (with its scales) comes from _set_kv_scales
            math = f", read into {str(self.dtype).removeprefix('torch.')} math" if kv_dtype != self.dtype else ""
            logger.info("KV cache in %s (--kv-cache-dtype %s)%s", str(kv_dtype).removeprefix("torch."),
                        cfg.kv_cache_dtype, math)  # fmt: skip
        per_page = KVPool.bytes_per_page(mc.num_layers, cfg.page_size, kv_heads, mc.head_dim, kv_dtype)
        if mla is not None:
            per_token = LatentPool.bytes_per_token(mc.num_layers, mla.kv_lora_rank, mla.qk_rope_head_dim, kv_dtype)
            per_page = per_token * cfg.page_size
            logger.info("MLA latent cache: %d bytes per token", per_token)
        if cfg.num_pages is not None:
            num_pages = cfg.num_pages
        else:
            if cfg.kv_cache_gb is not None:
                budget = int(cfg.kv_cache_gb * (1 << 30))
            else:
                budget = self.platform.kv_budget(cfg.memory_fraction)
            # Never more than every running request at full context could use.
            cap = cfg.max_running_requests * self.context_len // cfg.page_size + 1
            num_pages = max(1, min(budget // per_page, cap))
            if tp.size > 1:
                # Every rank must hold the same pool, or their scheduling decisions drift apart.
                import torch.distributed as dist

                if dist.is_initialized():
                    pages = torch.tensor([num_pages], dtype=torch.int64, device=self.device)
                    dist.all_reduce(pages, op=dist.ReduceOp.MIN)
                    num_pages = int(pages.item())
        if mla is not None:
            return LatentPool(mc.num_layers, num_pages, cfg.page_size, mla.kv_lora_rank, mla.qk_rope_head_dim,
                              kv_dtype, self.device)  # fmt: skip
        return KVPool(mc.num_layers, num_pages, cfg.page_size, kv_heads, mc.head_dim, kv_dtype, self.device, self.dtype)

    def _make_runner(self) -> "Runner":
        from minisgl.engine.graph import EagerRunner, GraphRunner, graph_batch_sizes

        cfg = self.config
        max_bs = graph_capacity(cfg.cuda_graph_max_bs, cfg.max_running_requests, cfg.decode_entries_per_request)
        graphs_ok = type(self.attn_backend).init_graph_state is not BaseAttnBackend.init_graph_state
        # Not with LoRA: the graphs would capture one step's adapter segments.
        if self.platform.supports_graphs and max_bs > 0 and graphs_ok and self.task == "generate" and self.lora is None:
            sizes = graph_batch_sizes(max_bs, cfg.max_running_requests, cfg.decode_entries_per_request)
            return GraphRunner(
                self.model, self.attn_backend, self.token_table, sizes,
                self.scratch_row, self.pool.scratch_slot, self.device, pin_memory=self.platform.pin_memory,
            )
        return EagerRunner(self.model, self.attn_backend)

    @property
    def scratch_row(self) -> int:
        return self.config.max_running_requests

    # ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def build_batch(self, plan: StepPlan, prev: LaunchedStep | None = None) -> tuple[ForwardBatch, list[Req]]:
        """The device batch of a plan, and the requests that sample a token in it."""
        built = self._build(plan, prev)
        return built.batch, built.sampled

    def _build(self, plan: StepPlan, prev: LaunchedStep | None, pad: bool = False) -> "_Built":
        """As `build_batch`; the logits rows are the sampled tokens, then the prompt-logprob rows
        (every prompt position of this step whose next token is also a prompt token, for the
        requests that asked for prompt logprobs). With `pad`, an eager (non-decode) batch gets
        padding tokens and logits rows up to `padded_rows` (`_Built.num_logits`: the real rows)."""
        input_ids: list[int] = []
        positions: list[int] = []
        rows_per_token: list[int] = []
        rows: list[int] = []
        seq_lens: list[int] = []
        ext_lens: list[int] = []
        starts: list[int] = []
        sample_idx: list[int] = []
        sampled: list[Req] = []
        pool_idx: list[int] = []
        pooled: list[Req] = []
        prompt_chunks: list[PromptChunk] = []
        prompt_idx: list[int] = []
        prompt_targets: list[int] = []
        drafts = plan.drafts
        for req in plan.reqs:  # hot loop: plain list and field access only
            row, begin, ext = req.row, req.cached_len, req.extend_len
            assert row is not None and ext > 0
            end = begin + ext
            prompt_len = len(req.prompt_ids)
            start = len(input_ids)
            starts.append(start)
            if drafts and req.rid in drafts:
                # Speculative decoding's verify row: one decode entry per position (the same row, each
                # attending up to its own position), sampled at each; a decode batch stays one.
                tokens = verify_row(req, drafts[req.rid])
                ext = len(tokens)
                input_ids.extend(tokens)
                positions.extend(range(begin, begin + ext))
                rows_per_token.extend([row] * ext)
                starts.extend(range(start + 1, start + ext))
                rows.extend([row] * ext)
                seq_lens.extend(range(begin + 1, begin + ext + 1))
                ext_lens.extend([1] * ext)
                sample_idx.extend(range(start, start + ext))
                sampled.extend([req] * ext)
                continue
            if ext == 1:
                input_ids.append(req.output_ids[begin - prompt_len] if begin >= prompt_len else req.prompt_ids[begin])
                positions.append(begin)
                rows_per_token.append(row)
            else:
                input_ids.extend(req.token_slice(begin, end))
                positions.extend(range(begin, end))
                rows_per_token.extend([row] * ext)
            if begin < prompt_len - 1 and req.sampling.prompt_logprobs is not None:
                count = min(end, prompt_len - 1) - begin
                prompt_chunks.append(PromptChunk(req, begin + 1, count))
                prompt_idx.extend(range(start, start + count))
                prompt_targets.extend(req.prompt_ids[begin + 1 : begin + 1 + count])
            rows.append(row)
            seq_lens.append(end)
            ext_lens.append(ext)
            if end == prompt_len + len(req.output_ids):
                if req.pooling is None:
                    sample_idx.append(len(input_ids) - 1)
                    sampled.append(req)
                else:  # an embedding request's last prompt token: its hidden state, no sampling
                    pool_idx.append(len(input_ids) - 1)
                    pooled.append(req)
        assert len(plan.out_loc) == len(input_ids)
        if self.lora is not None:  # the adapter segments of this step's tokens
            self.lora.prepare([(req.lora_id, req.extend_len) for req in plan.reqs])
        # Decode (the graph path) only when every token is a request's sampled token, in order.
        decode = len(input_ids) == len(ext_lens) == len(sample_idx) and not prompt_idx and not pool_idx
        out_loc_list = plan.out_loc
        logits_idx = sample_idx + prompt_idx
        num_logits = len(logits_idx)
        original = self.model_config.long_rope_from
        long_rope = original is not None and any(req.long_rope for req in plan.reqs)
        # A decode step a captured graph replays goes to the runner's buffers in one copy.
        if decode and not long_rope and not plan.table_rows and len(plan.from_prev) in (0, len(input_ids)):
            src = [j for _, j in plan.from_prev]  # every token in flight: token i is the step's i-th
            staged = self.runner.stage_decode(input_ids, positions, out_loc_list, rows, seq_lens,
                                              prev.tokens if src and prev is not None else None, src)  # fmt: skip
            if staged is not None:
                return _Built(staged, sampled, prompt_chunks, self._no_targets, num_logits, pooled)
        if pad and not decode:
            # Padding tokens: token 0 at position 0 of the scratch row (whose table entry becomes the
            # scratch slot), KV to the scratch slot. No request's attention covers them, and every
            # other op works row by row; their logits rows repeat the last real one.
            extra = padded_rows(len(input_ids)) - len(input_ids)
            input_ids = input_ids + [0] * extra
            rows_per_token = rows_per_token + [self.scratch_row] * extra
            positions = positions + [0] * extra
            out_loc_list = out_loc_list + [self.pool.scratch_slot] * extra
            logits_idx = logits_idx + logits_idx[-1:] * (padded_rows(num_logits) - num_logits)
        dst, src = [t for t, _ in plan.from_prev], [j for _, j in plan.from_prev]
        # The token-table entries are this step's tokens, then the plan's extra ones: `positions`
        # is the head of the table positions.
        # The first four parts lie one padded length apart in a decode step (`stacked` below).
        (ids_t, table_pos, out_loc, rows_t, table_rows, sample_t, dst_t, src_t, targets_t,
         seq_t, ext_t, starts_t, table_slots) = upload_many(self._staging, self.device, [
            input_ids, positions + plan.table_pos, out_loc_list, rows, rows_per_token + plan.table_rows,
            logits_idx, dst, src, prompt_targets,
            seq_lens, ext_lens, starts, out_loc_list + plan.table_slots,
        ], int32_tail=4)  # fmt: skip
        pos_t = table_pos[: len(positions)]
        if long_rope and original is not None:  # rotary rows, not positions
            spans = [(s, s + n) for req, s, n in zip(plan.reqs, starts, ext_lens) if req.long_rope]
            rope_rows = long_rope_rows(positions, spans, self.model_config.context_len, original)
            pos_t = upload(rope_rows, torch.int64, self.device)
        if dst:
            # Tokens sampled by the step still in flight: read them on the device.
            assert prev is not None
            if len(dst) == len(input_ids):  # every token (a decode step): one gather, in place
                torch.index_select(prev.tokens, 0, src_t, out=ids_t)
            else:
                ids_t = ids_t.clone()
                ids_t[dst_t] = prev.tokens[src_t]
        self.token_table.index_put_((table_rows, table_pos), table_slots)
        # None where a part was uploaded apart (LongRoPE's rotary rows): `stacked` checks the memory.
        block = stacked([ids_t, pos_t, out_loc, rows_t]) if decode else None
        batch = ForwardBatch(
            phase="decode" if decode else "extend",
            input_ids=ids_t,
            positions=pos_t,
            out_loc=out_loc,
            rows=rows_t,
            seq_lens=seq_t,
            extend_lens=ext_t,
            extend_starts=starts_t,
            token_table=self.token_table,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=ext_lens,
            sample_idx=sample_t,
            pool_idx=upload(pool_idx, torch.int64, self.device) if pool_idx else None,
            decode_block=block,
        )
        return _Built(batch, sampled, prompt_chunks, targets_t, num_logits, pooled)

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of the tokens in `batch.sample_idx`: [S, vocab]."""
        return self.runner.run(batch)

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step on the device and return at once; `result()` waits for its tokens.

        `prev` is the step still in flight whose sampled tokens this plan reads (`plan.from_prev`)."""
        if plan.released_rids:
            self.penalties.release(plan.released_rids)
        built = self._build(plan, prev, pad=self.pad_eager)
        sampled = built.sampled
        pooled = None
        if self.pooler is not None:  # an embedding model (no LM head): hidden states of the last prompt tokens
            logits, hidden = self.runner.run_pooled(built.batch)
            if built.pooled:
                pooled = PooledRows(built.pooled, hidden.float().to("cpu", non_blocking=True), self.pooler.normalize)
        else:
            assert not built.pooled, "embedding requests reach an engine serving embeddings only"
            logits = self.runner.run(built.batch)  # (forward_logits without its second inference_mode entry)
        logits = logits[: built.num_logits]
        num_sampled = len(sampled)
        prompt_lp = None
        if built.prompt_chunks:
            top_k = max(chunk.req.sampling.prompt_logprobs or 0 for chunk in built.prompt_chunks)
            prompt_lp = host_copy(chunked_logprobs(logits[num_sampled:], built.prompt_targets, top_k))
        if not sampled and prompt_lp is None:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return LaunchedStep([], empty, empty.cpu(), self._record(pooled) if pooled else None, pooled=pooled)
        logits = logits[:num_sampled]
        params = [req.sampling for req in sampled]
        output_lens = row_steps(sampled) if plan.drafts else [req.output_len for req in sampled]
        sampling = SamplingBatch.build(params, output_lens, logits.shape[-1], self.device)
        if plan.controls:
            sampling.controls = self._controls(sampled, params, output_lens, plan.grammars)
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None] if plan.controls else []
        token_lp = None
        with self.platform.serial_torch_ops():  # CPU: too small for torch's threads (platform/cpu.py)
            tokens = self.sampler.sample(logits, sampling)
            if sampling.controls is not None and sampling.controls.penalties is not None:
                self.penalties.update(sampling.controls.penalties, tokens)
            if logprob_rows:
                index = upload(logprob_rows, torch.int64, self.device)
                top_k = max(params[i].logprobs or 0 for i in logprob_rows)
                token_lp = host_copy(token_logprobs(logits[index], tokens[index], top_k))
        host = self._token_staging.take(tokens.numel())
        host.copy_(tokens, non_blocking=True)
        event = self._record(pooled)
        return LaunchedStep(sampled, tokens, host, event, logprob_rows, token_lp, built.prompt_chunks, prompt_lp,
                            pooled)  # fmt: skip

    def _record(self, pooled: PooledRows | None) -> Any:
        """Record this step's event (its host copies are valid once it completes)."""
        event = self._events[self._step_parity]
        self._step_parity ^= 1
        event.record()
        if pooled is not None:
            pooled.event = event
        return event

    def _controls(
        self, sampled: list[Req], params: list[SamplingParams], output_lens: list[int], grammars: dict[int, GrammarState]
    ) -> LogitsControls | None:
        """Logit adjustments of this step, or None when no sampled request uses any (the usual case)."""
        if not grammars and not any(
            p.logit_bias or p.min_tokens or p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
            for p in params
        ):
            return None
        bitmask = None
        if grammars:
            constrained = [i for i, req in enumerate(sampled) if req.rid in grammars]
            if constrained:
                width = bitmask_width(self.model_config.vocab_size)
                mask = torch.full((len(constrained), width), -1, dtype=torch.int32)
                for j, i in enumerate(constrained):
                    grammars[sampled[i].rid].fill_bitmask(mask, j)
                if self.platform.pin_memory:
                    mask = mask.pin_memory()
                bitmask = (upload(constrained, torch.int64, self.device), mask.to(self.device, non_blocking=True))
        penalties = self.penalties.prepare(sampled)
        eos_ids = self.model_config.eos_ids
        return LogitsControls.build(params, output_lens, eos_ids, self.device, penalties, bitmask)

    def step(self, plan: StepPlan) -> ForwardOut:
        launched = self.launch(plan)
        return ForwardOut(launched.sampled_reqs, launched.result())


class _Built(NamedTuple):
    batch: ForwardBatch
    sampled: list[Req]
    prompt_chunks: list[PromptChunk]
    prompt_targets: torch.Tensor  # [sum of chunk counts] int64 on the device
    num_logits: int  # logits rows before padding: the sampled tokens, then the prompt-logprob rows
    pooled: list[Req]  # embedding requests whose last prompt token is in this step (`batch.pool_idx`)
