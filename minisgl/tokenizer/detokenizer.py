"""The detokenizer process: scheduler token ids -> text deltas for the API server.

One `TokenOutMsg` (one scheduler step, many requests, with the facts of the requests it admitted)
becomes one `TextDeltaMsg`, decoded with a single batched call. A request that hits a stop string
is finished here and aborted straight at rank 0 of the replica that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.message.codec import WIRE
from minisgl.message.frontend import TextDeltaMsg
from minisgl.message.scheduler import AbortMsg, ShutdownMsg
from minisgl.message.tokenizer import TokenOutMsg
from minisgl.tokenizer.incremental import BatchDecode, DetokResult, IncrementalDetokenizer
from minisgl.tokenizer.token_text import TokenText, fast_token_text, slow_token_text
from minisgl.utils.logging import get_logger
from minisgl.utils.memory import trim_heap
from minisgl.utils.process import ReadyReporter

logger = get_logger(__name__)


@dataclass(frozen=True)
class DetokenizerAddrs:
    recv: str
    schedulers: tuple[str, ...]  # rank 0 of each replica: stop-string aborts
    frontend: str


def make_decoders(model_dir: str) -> tuple[BatchDecode, TokenText, BatchDecode]:
    """Batched decode, per-token text (for logprobs) and the batched decode that keeps special
    tokens (reasoning parsers that read them). Prefer the Rust `tokenizers` object (fast to load,
    batched decode without space clean-up); fall back to transformers for tokenizers without a
    tokenizer.json."""
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(path))

        def decode_fast(seqs: list[list[int]]) -> list[str]:
            return list(fast.decode_batch(seqs, skip_special_tokens=True))

        def decode_fast_special(seqs: list[list[int]]) -> list[str]:
            return list(fast.decode_batch(seqs, skip_special_tokens=False))

        return decode_fast, fast_token_text(fast), decode_fast_special
    from transformers import AutoTokenizer

    slow: Any = AutoTokenizer.from_pretrained(model_dir)

    def decode_hf(seqs: list[list[int]], skip: bool = True) -> list[str]:
        return [slow.decode(seq, skip_special_tokens=skip, clean_up_tokenization_spaces=False) for seq in seqs]

    return decode_hf, slow_token_text(slow), lambda seqs: decode_hf(seqs, skip=False)


def run_detokenizer(model_dir: str, addrs: DetokenizerAddrs, ready: ReadyReporter) -> None:
    """Process entry point (zmq is imported here: the offline `LLM` uses `make_decoders` without sockets)."""
    from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

    recv: ZmqPullQueue[object] = ZmqPullQueue(addrs.recv, WIRE)
    to_scheds: list[ZmqPushQueue[object]] = [ZmqPushQueue(addr, WIRE) for addr in addrs.schedulers]
    to_front: ZmqPushQueue[object] = ZmqPushQueue(addrs.frontend, WIRE)
    detok = IncrementalDetokenizer(*make_decoders(model_dir))
    trim_heap()  # tokenizer.json's parse temporaries (utils/memory.py)
    ready.ready()

    def send(result: DetokResult) -> None:
        for rid in result.aborts:
            to_scheds[detok.replica_of(rid)].put(AbortMsg(rid))
        if result.deltas:
            to_front.put(TextDeltaMsg(result.deltas))

    while True:
        msg = recv.get()
        if isinstance(msg, TokenOutMsg):
            send(detok.handle(msg))
        elif isinstance(msg, ShutdownMsg):
            break
        else:
            logger.warning("detokenizer: ignoring unexpected message %s", type(msg).__name__)
