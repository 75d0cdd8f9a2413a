"""The request's entry (`RequestTokenizer`, the one path of the server, the shell and the offline
`LLM`) checks a request's content against the engine once: empty prompt, context, vocabulary,
KV pool, and fits an unset max_tokens. After it the request travels as one validated object:
decoding it from the wire does not check it again, and the API server encodes each message once."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from minisgl.core import SamplingParams
from minisgl.message.codec import WIRE, WireCodec
from minisgl.message.frontend import ErrorMsg
from minisgl.message.scheduler import TokenizedMsg
from minisgl.message.tokenizer import EngineLimitsMsg, TextPrompt, TokenizeMsg, TokenPrompt
from minisgl.tokenizer.request import PromptError, RequestTokenizer


class _CharTokenizer:
    """One token per character: its code point (so text can make ids beyond a small vocabulary)."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def entry(context_len: int = 32, vocab_size: int = 50, pool_tokens: int = 16) -> RequestTokenizer:
    return RequestTokenizer(_CharTokenizer(), EngineLimitsMsg(context_len, vocab_size, pool_tokens))


def ids_msg(ids: list[int], explicit: bool = True, **sampling: Any) -> TokenizeMsg:
    return TokenizeMsg(0, TokenPrompt(ids), SamplingParams(**sampling), explicit)


def refused(req: RequestTokenizer, msg: TokenizeMsg) -> PromptError:
    with pytest.raises(PromptError) as info:
        req.tokenize(msg)
    return info.value


def test_entry_rejects_bad_input() -> None:
    # (moved from the scheduler's add_request test: the same messages, checked once, here)
    req = entry(context_len=32, vocab_size=50, pool_tokens=16)
    ok = {"max_tokens": 4}
    with pytest.raises(ValueError, match="empty"):
        req.tokenize(ids_msg([], **ok))
    with pytest.raises(ValueError, match="context length is 32"):
        req.tokenize(ids_msg([1] * 32, **ok))
    with pytest.raises(ValueError, match="more than the pool holds"):
        req.tokenize(ids_msg([1] * 10, max_tokens=7))  # 17 tokens > 16 slots
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        req.tokenize(ids_msg([1, 50], **ok))
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        req.tokenize(ids_msg([-1, 2], **ok))
    assert req.tokenize(ids_msg([1] * 10, max_tokens=6)).msg.sampling.max_tokens == 6  # exactly 16 tokens fits


@pytest.mark.parametrize(
    "msg, param",
    [(ids_msg([1] * 10, max_tokens=7), "max_tokens"),
     (ids_msg([1, 2], logit_bias={50: 1.0}), "logit_bias"),
     (ids_msg([1, 2], stop_token_ids=[3, 50]), "stop_token_ids"),
     (ids_msg([1, 99]), "prompt"),
     (TokenizeMsg(0, TextPrompt("a"), SamplingParams(max_tokens=2)), "prompt"),  # the tokenizer's id 97 >= 50
     (ids_msg([1] * 16, explicit=False), "prompt"),  # the prompt alone fills the pool
     (ids_msg([1] * 10, explicit=False, max_tokens=9, min_tokens=7), "min_tokens")],
)  # fmt: skip
def test_refusals_name_their_field(msg: TokenizeMsg, param: str) -> None:
    req = entry(context_len=32, vocab_size=50, pool_tokens=16)
    assert refused(req, msg).param == param
    reply = req.handle(msg)  # what the tokenizer process sends the API server
    assert isinstance(reply, ErrorMsg) and reply.status == 400 and reply.param == param


def test_unset_max_tokens_is_fitted_to_the_context_and_the_pool() -> None:
    pool_bound = entry(context_len=32, pool_tokens=16).tokenize(ids_msg([1] * 10, explicit=False, max_tokens=100))
    assert pool_bound.msg.sampling.max_tokens == 6
    context_bound = entry(context_len=32, pool_tokens=1000).tokenize(ids_msg([1] * 10, explicit=False, max_tokens=100))
    assert context_bound.msg.sampling.max_tokens == 22
    ceiling = entry(context_len=32, pool_tokens=1000).tokenize(ids_msg([1] * 10, explicit=False, max_tokens=5))
    assert ceiling.msg.sampling.max_tokens == 5
    # The scheduler gets the fitted value and nothing to fit it again with.
    assert "max_tokens_explicit" not in {f.name for f in dataclasses.fields(TokenizedMsg)}


def test_min_tokens_beyond_the_context_is_refused_when_max_tokens_is_unset() -> None:
    err = refused(entry(context_len=32, pool_tokens=1000), ids_msg([1] * 30, explicit=False, max_tokens=9, min_tokens=5))
    assert err.param == "min_tokens" and "fit in the context" in str(err)


def test_the_wire_carries_the_validated_object_without_checking_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    sampling = SamplingParams(temperature=0.5, top_k=-1, stop="END", logit_bias={3: 2.0}, regex="a+", max_tokens=9)
    data = WIRE.encode(TokenizedMsg(1, [1, 2], sampling))

    def checked_again(self: SamplingParams) -> None:
        raise AssertionError("a decoded SamplingParams was validated again")

    monkeypatch.setattr(SamplingParams, "__post_init__", checked_again)
    decoded = WIRE.decode(data)
    assert decoded.sampling == sampling and decoded.sampling.top_k is None and decoded.sampling.stop == ["END"]


def test_the_api_server_encodes_each_message_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from minisgl.server import frontend
    from minisgl.server.frontend import FrontendAddrs, FrontendManager
    from minisgl.utils.zmq import ZmqPullQueue

    encoded: list[object] = []

    def counting_encode(obj: object) -> bytes:
        encoded.append(obj)
        return WIRE.encode(obj)

    monkeypatch.setattr(frontend, "WIRE", WireCodec(counting_encode, WIRE.decode))
    addr = f"ipc://{tmp_path}"
    tokenizer: ZmqPullQueue[object] = ZmqPullQueue(f"{addr}/t", WIRE)

    def receive() -> object:
        # The sockets close with linger 0, so the messages are taken before the manager closes;
        # a bounded wait makes a lost message a failure here, not a suite timeout.
        assert tokenizer.poll(30_000), "the tokenizer queue got nothing within 30 s"
        return tokenizer.get()

    async def main() -> tuple[list[TokenizeMsg], list[object]]:
        fm = FrontendManager(FrontendAddrs(recv=f"{addr}/f", tokenizer=f"{addr}/t", scheduler=f"{addr}/s"))
        inbox = fm.open(3)
        msgs = [TokenizeMsg(rid, TextPrompt("hi"), SamplingParams(max_tokens=2)) for rid in inbox.rids]
        await fm.submit(msgs)
        received = [receive() for _ in msgs]
        fm.release(inbox)
        await fm.close()
        return msgs, received

    try:
        msgs, got = asyncio.run(main())
    finally:
        tokenizer.close()
    assert got == msgs
    assert [m for m in encoded if isinstance(m, TokenizeMsg)] == msgs  # one encode per message, none again


class _LimitsScheduler:
    context_len, vocab_size, page_size = 64, 50, 4

    def stats(self) -> Any:
        from minisgl.message.frontend import SchedulerStats

        return SchedulerStats(total_pages=8, free_pages=8, cached_pages=0, evictable_pages=0, running=0, waiting=0)


def test_rank_0_tells_the_tokenizer_its_limits(tmp_path: Path) -> None:
    from minisgl.scheduler.process import SchedulerAddrs, SchedulerLoop
    from minisgl.utils.zmq import ZmqPullQueue

    addr = f"ipc://{tmp_path}"
    tokenizer: ZmqPullQueue[object] = ZmqPullQueue(f"{addr}/t", WIRE)
    addrs = SchedulerAddrs(recv=f"{addr}/s", detokenizer=f"{addr}/d", frontend=f"{addr}/f", tokenizer=f"{addr}/t")
    loop = SchedulerLoop(_LimitsScheduler(), addrs, rank=0)  # type: ignore[arg-type]
    try:
        loop.announce_limits()
        assert tokenizer.poll(5000) and tokenizer.get() == EngineLimitsMsg(64, 50, 32)
    finally:
        loop.close()
        tokenizer.close()


def test_the_tokenizer_checks_against_what_every_replica_can_serve() -> None:
    from minisgl.tokenizer.worker import engine_limits

    reports = [EngineLimitsMsg(4096, 49152, 8192), EngineLimitsMsg(4096, 49152, 4096)]
    assert engine_limits(reports, context_len=4096) == EngineLimitsMsg(4096, 49152, 4096)
    assert engine_limits(reports, context_len=2048).context_len == 2048  # the launcher's, as the API server's
