"""Incremental detokenizer: UTF-8 safety, no re-emission, whole added tokens, stop strings."""

from __future__ import annotations

import pytest

from minisgl.message.tokenizer import DetokFacts, TokenOut, TokenOutMsg
from minisgl.tokenizer.incremental import IncrementalDetokenizer, StopFilter

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tok():  # a byte-level BPE without merges: every byte is a token, plus added tokens
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken("<eos>", special=True)])
    t.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    return t


def make(tok) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(lambda seqs: tok.decode_batch(seqs, skip_special_tokens=True))


def run(tok, text_ids: list[int], stop: list[str] | None = None, step: int = 1, finish="length"):
    detok = make(tok)
    detok.register(DetokFacts(rid=7, prompt_tail_ids=tok.encode("Hi:").ids, stop=stop or []))
    deltas, aborts = [], []
    chunks = [text_ids[i : i + step] for i in range(0, len(text_ids), step)]
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        res = detok.process([TokenOut(7, chunk, finish if last else None, 3, 0, i + 1)])
        deltas += res.deltas
        aborts += res.aborts
        if res.deltas and res.deltas[-1].finish_reason is not None:
            break
    return deltas, aborts, detok


@pytest.mark.parametrize("step", [1, 2, 3])
def test_utf8_never_split_and_concat_equals_full(tok, step):
    text = "héllo wörld 你好 🙂 done"
    ids = tok.encode(text).ids
    deltas, aborts, detok = run(tok, ids, step=step)
    assert "".join(d.text for d in deltas) == text
    assert all("\ufffd" not in d.text for d in deltas)
    assert deltas[-1].finish_reason == "length" and not aborts
    assert sum(len(d.token_ids) for d in deltas) == len(ids)
    assert detok.states == {}


def test_special_skipped_added_token_whole(tok):
    ids = tok.encode("<think>ok</think>yes").ids + tok.encode("<eos>").ids
    deltas, _, _ = run(tok, ids, finish="stop")
    texts = [d.text for d in deltas]
    assert "<think>" in texts and "</think>" in texts
    assert "".join(texts) == "<think>ok</think>yes"


def test_stop_string_not_emitted_and_aborts(tok):
    ids = tok.encode("one two STOP three").ids
    deltas, aborts, detok = run(tok, ids, stop=["STOP"])
    assert "".join(d.text for d in deltas) == "one two "
    assert deltas[-1].finish_reason == "stop"
    assert aborts == [7] and 7 in detok.stopped
    # the scheduler's abort output is swallowed and ends the bookkeeping
    assert detok.process([TokenOut(7, [], "abort", 3, 0, 9)]).deltas == []
    assert detok.stopped == {} and detok.states == {}


def test_partial_stop_held_then_released(tok):
    ids = tok.encode("a ST b").ids
    deltas, aborts, _ = run(tok, ids, stop=["STOP"])
    assert "".join(d.text for d in deltas) == "a ST b" and not aborts
    # "S" / "ST" must never be emitted before it is known not to start "STOP"
    emitted = ""
    for d in deltas:
        emitted += d.text
        assert not emitted.endswith("S") and not emitted.endswith("ST")


def test_stop_filter_unit():
    f = StopFilter(["\n\n", "END"])
    assert f.feed("abc\n") == ("abc", None)
    assert f.feed("x E") == ("\nx ", None)
    assert f.feed("N") == ("", None)
    assert f.feed("D tail") == ("", "END")
    assert StopFilter([]).feed("anything") == ("anything", None)
    keep = StopFilter(["END", "ND!"], include=True)
    assert keep.feed("a EN") == ("a ", None)
    assert keep.feed("D! b") == ("END", "END")  # the earliest match wins, and is kept
    idle = StopFilter(["END"])
    assert idle.feed("x EN", active=False) == ("x EN", None)  # min_tokens not reached: no holdback
    assert idle.feed("D", active=True) == ("D", None)


def test_facts_and_first_output_in_one_message_need_no_parking(tok):
    """A request admitted in the scheduler iteration that also produced its first token: its
    facts ride on the same TokenOutMsg, before the outputs, so the token decodes at once."""
    detok = make(tok)
    ids = tok.encode("xy").ids
    msg = TokenOutMsg([TokenOut(1, ids, "length", 2, 0, 2)], [DetokFacts(1, tok.encode("Hi:").ids, [])])
    res = detok.handle(msg)
    assert [d.text for d in res.deltas] == ["xy"] and res.deltas[0].finish_reason == "length"
    assert detok.states == {} and not hasattr(detok, "pending")


def test_output_of_an_ended_request_is_dropped_not_parked(tok):
    detok = make(tok)
    assert detok.process([TokenOut(5, tok.encode("z").ids, None, 1, 0, 1)]).deltas == []
    assert detok.states == {} and detok.stopped == {}
    # a later request decodes normally: nothing of the dropped output was kept
    res = detok.handle(TokenOutMsg([TokenOut(6, tok.encode("ok").ids, "stop", 1, 0, 2)], [DetokFacts(6)]))
    assert [d.text for d in res.deltas] == ["ok"]


def test_stop_string_abort_goes_to_the_replica_of_the_request(tok):
    detok = make(tok)
    detok.handle(TokenOutMsg([], [DetokFacts(3, [], ["STOP"], replica=2), DetokFacts(4, [], ["STOP"])]))
    res = detok.process([TokenOut(3, tok.encode("a STOP").ids, None, 1, 0, 6),
                         TokenOut(4, tok.encode("b STOP").ids, None, 1, 0, 6)])  # fmt: skip
    assert res.aborts == [3, 4]
    assert detok.replica_of(3) == 2 and detok.replica_of(4) == 0


def test_many_requests_one_batch_no_cross_talk(tok):
    detok = make(tok)
    words = {rid: f"req{rid} says ünïcode {rid}" for rid in range(20)}
    enc = {rid: tok.encode(w).ids for rid, w in words.items()}
    for rid in words:
        detok.register(DetokFacts(rid, [], []))
    got = {rid: "" for rid in words}
    longest = max(len(v) for v in enc.values())
    for i in range(longest):
        outs = [
            TokenOut(rid, ids[i : i + 1], "stop" if i == len(ids) - 1 else None, 1, 0, i + 1)
            for rid, ids in enc.items()
            if i < len(ids)
        ]
        for d in detok.process(outs).deltas:
            got[d.rid] += d.text
    assert got == words and detok.states == {}


def _feed(detok, rid: int, ids: list[int], finish: str, logprobs: bool = False) -> list:
    deltas = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        raw = [[-0.5 - i, [[token, -0.5 - i], [0, -9.0]]]] if logprobs else None
        deltas += detok.process([TokenOut(rid, [token], finish if last else None, 3, 0, i + 1, raw)]).deltas
    return deltas


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id_text_dropped_and_reported(tok, include):
    ids = tok.encode("ab.").ids
    dot = ids[-1]
    detok = make(tok)
    detok.register(DetokFacts(1, [], [], stop_token_ids=[dot], include_stop=include))
    deltas = _feed(detok, 1, ids, "stop")
    assert "".join(d.text for d in deltas) == ("ab." if include else "ab")
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == dot
    assert sum(len(d.token_ids) for d in deltas) == len(ids)  # the stop token is still counted


def test_stop_string_reported_and_kept_with_include(tok):
    detok = make(tok)
    detok.register(DetokFacts(2, [], ["STOP"], include_stop=True))
    deltas = _feed(detok, 2, tok.encode("one STOP two").ids, "length")
    assert "".join(d.text for d in deltas) == "one STOP"
    assert deltas[-1].stop_reason == "STOP" and deltas[-1].finish_reason == "stop"


def test_eos_stop_has_no_stop_reason(tok):
    detok = make(tok)
    detok.register(DetokFacts(3, [], ["zz"], stop_token_ids=[5]))
    deltas = _feed(detok, 3, tok.encode("hi<eos>").ids, "stop")
    assert deltas[-1].stop_reason is None and "".join(d.text for d in deltas) == "hi"


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode("a.b.c").ids  # one token per byte
    detok = make(tok)
    detok.register(DetokFacts(4, [], ["."], min_tokens=3))
    deltas = _feed(detok, 4, ids, "length")
    assert "".join(d.text for d in deltas) == "a.b"  # the first "." came before min_tokens


def test_logprobs_ride_with_their_tokens(tok):
    ids = tok.encode("x STOP y").ids
    detok = make(tok)
    detok.register(DetokFacts(5, [], ["STOP"]))
    deltas = _feed(detok, 5, ids, "length", logprobs=True)
    got = [entry for d in deltas for entry in (d.logprobs or [])]
    assert [e.token_id for e in got] == [t for d in deltas for t in d.token_ids]
    assert all(len(d.logprobs or []) == len(d.token_ids) for d in deltas)
    assert [e.logprob for e in got] == [-0.5 - i for i in range(len(got))]
    assert got[0].top[0].token_id == ids[0] and got[0].top[1].logprob == -9.0
    assert got[0].token == "x" and got[0].raw == b"x"


def test_echo_first_delta_has_prompt_text_and_logprobs(tok):
    prompt = tok.encode("Hi there").ids
    detok = make(tok)
    detok.register(DetokFacts(6, prompt[-5:], [], echo_ids=prompt))
    raw_prompt = [[None, []]] + [[-1.0, [[t, -1.0]]] for t in prompt[1:]]
    first = detok.process([TokenOut(6, [prompt[0]], None, len(prompt), 0, 1, [[-0.1, []]], raw_prompt)]).deltas
    assert first[0].prompt_text == "Hi there"
    entries = first[0].prompt_logprobs or []
    assert [e.token_id for e in entries] == prompt and entries[0].logprob is None and entries[1].logprob == -1.0
    more = detok.process([TokenOut(6, [prompt[1]], "length", len(prompt), 0, 2, [[-0.2, []]])]).deltas
    assert more[0].prompt_text is None and more[0].prompt_logprobs is None


def test_token_text_bytes_of_byte_level_pieces(tok):
    from minisgl.tokenizer.token_text import fast_token_text

    text_of = fast_token_text(tok)
    ids = tok.encode("é").ids  # two byte tokens
    assert [text_of(i)[1] for i in ids] == [b"\xc3", b"\xa9"]
    assert text_of(ids[0])[0] == "\ufffd"
    (think,) = tok.encode("<think>").ids
    assert text_of(think) == ("<think>", b"<think>")
