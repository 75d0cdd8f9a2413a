"""Incremental detokenizer: UTF-8 safety, no re-emission, whole added tokens, stop strings."""

from __future__ import annotations

import pytest

from minisgl.message.tokenizer import DetokRegisterMsg, TokenOut
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
    detok.register(DetokRegisterMsg(rid=7, prompt_tail_ids=tok.encode("Hi:").ids, stop=stop or []))
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
    assert detok.stopped == set() and detok.pending == {}


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
    assert f.feed("abc\n") == ("abc", False)
    assert f.feed("x E") == ("\nx ", False)
    assert f.feed("N") == ("", False)
    assert f.feed("D tail") == ("", True)
    assert StopFilter([]).feed("anything") == ("anything", False)


def test_output_before_register_is_replayed(tok):
    detok = make(tok)
    ids = tok.encode("xy").ids
    assert detok.process([TokenOut(1, ids, "length", 2, 0, 2)]).deltas == []
    res = detok.register(DetokRegisterMsg(1, [], []))
    assert [d.text for d in res.deltas] == ["xy"] and detok.pending == {}


def test_many_requests_one_batch_no_cross_talk(tok):
    detok = make(tok)
    words = {rid: f"req{rid} says ünïcode {rid}" for rid in range(20)}
    enc = {rid: tok.encode(w).ids for rid, w in words.items()}
    for rid in words:
        detok.register(DetokRegisterMsg(rid, [], []))
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
