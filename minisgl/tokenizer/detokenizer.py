"""The detokenizer process: scheduler token ids -> text deltas for the API server.

One `TokenOutMsg` (one scheduler step, many requests) becomes one `TextDeltaMsg`, decoded with a
single batched call. A request that hits a stop string is finished here and aborted in the
scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.message.frontend import ErrorMsg, TextDeltaMsg
from minisgl.message.scheduler import AbortMsg, ShutdownMsg
from minisgl.message.tokenizer import DetokRegisterMsg, TokenOutMsg
from minisgl.tokenizer.incremental import BatchDecode, DetokResult, IncrementalDetokenizer
from minisgl.tokenizer.token_text import TokenText, fast_token_text, slow_token_text
from minisgl.utils.logging import get_logger
from minisgl.utils.process import ReadyReporter
from minisgl.utils.zmq import ZmqPullQueue, ZmqPushQueue

logger = get_logger(__name__)


@dataclass(frozen=True)
class DetokenizerAddrs:
    recv: str
    scheduler: str  # stop-string aborts
    frontend: str


def make_decoders(model_dir: str) -> tuple[BatchDecode, TokenText]:
    """Batched decode and per-token text (for logprobs). Prefer the Rust `tokenizers` object
    (fast to load, batched decode without space clean-up); fall back to transformers for
    tokenizers without a tokenizer.json."""
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(path))

        def decode_fast(seqs: list[list[int]]) -> list[str]:
            return list(fast.decode_batch(seqs, skip_special_tokens=True))

        return decode_fast, fast_token_text(fast)
    from transformers import AutoTokenizer

    slow: Any = AutoTokenizer.from_pretrained(model_dir)

    def decode_hf(seqs: list[list[int]]) -> list[str]:
        return [
            slow.decode(seq, skip_special_tokens=True, clean_up_tokenization_spaces=False) for seq in seqs
        ]

    return decode_hf, slow_token_text(slow)


def run_detokenizer(model_dir: str, addrs: DetokenizerAddrs, ready: ReadyReporter) -> None:
    """Process entry point."""
    recv: ZmqPullQueue[object] = ZmqPullQueue(addrs.recv)
    to_sched: ZmqPushQueue[object] = ZmqPushQueue(addrs.scheduler)
    to_front: ZmqPushQueue[object] = ZmqPushQueue(addrs.frontend)
    detok = IncrementalDetokenizer(*make_decoders(model_dir))
    ready.ready()

    def send(result: DetokResult) -> None:
        for rid in result.aborts:
            to_sched.put(AbortMsg(rid))
        if result.deltas:
            to_front.put(TextDeltaMsg(result.deltas))
        for err in result.errors:
            to_front.put(err)

    while True:
        msg = recv.get()
        if isinstance(msg, TokenOutMsg):
            send(detok.process(msg.outs))
        elif isinstance(msg, DetokRegisterMsg):
            send(detok.register(msg))
        elif isinstance(msg, ErrorMsg):
            send(detok.fail(msg))
        elif isinstance(msg, ShutdownMsg):
            break
        else:
            logger.warning("detokenizer: ignoring unexpected message %s", type(msg).__name__)
