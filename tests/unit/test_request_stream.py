"""The request's detokenizer facts travel in the scheduler's ordered output stream (no side
channel, no parking), and a stop string's abort goes from the detokenizer straight to rank 0 of
the replica holding the request (not through the tokenizer). Real ZMQ sockets, fake scheduler."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from minisgl.message.codec import WIRE
from minisgl.message.frontend import ErrorMsg, SchedulerStats, TextDeltaMsg
from minisgl.message.scheduler import AbortMsg, ShutdownMsg, TokenizedMsg
from minisgl.message.tokenizer import DetokFacts, TokenOut, TokenOutMsg
from minisgl.scheduler.process import SchedulerAddrs, SchedulerLoop
from minisgl.tokenizer.incremental import IncrementalDetokenizer
from minisgl.utils.process import ReadyReporter
from minisgl.utils.zmq import IpcDir, ZmqPullQueue, ZmqPushQueue

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture
def ipc():
    d = IpcDir()
    yield d
    d.cleanup()


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return t


class FakeScheduler:
    """Emits its requests' scripted tokens, one per step; refuses prompts longer than 8."""

    page_size = 1

    def __init__(self, scripts: dict[int, list[int]]) -> None:
        self.scripts = scripts
        self.live: dict[int, int] = {}  # rid -> tokens emitted

    def stats(self) -> SchedulerStats:
        return SchedulerStats(100, 100, 0, 0, len(self.live), 0)

    def add_request(self, rid: int, ids: list[int], sampling: object, pooling: object = None, lora: object = None) -> None:
        if len(ids) > 8:
            raise ValueError("the request needs more than the pool holds")
        self.live[rid] = 0

    def abort(self, rid: int) -> bool:
        return self.live.pop(rid, None) is not None

    def has_work(self) -> bool:
        return bool(self.live)

    def step(self) -> list[TokenOut]:
        outs = []
        for rid in list(self.live):
            i = self.live[rid]
            done = i + 1 == len(self.scripts[rid])
            outs.append(TokenOut(rid, [self.scripts[rid][i]], "length" if done else None, 2, 0, i + 1))
            self.live[rid] = i + 1
            if done:
                del self.live[rid]
        return outs


def test_facts_ride_before_the_first_output_on_one_stream(ipc, tok):
    ids = tok.encode("hi").ids
    sched = FakeScheduler({1: ids})
    addrs = SchedulerAddrs(recv=ipc.addr("sched"), detokenizer=ipc.addr("detok"), frontend=ipc.addr("front"))
    detok_in: ZmqPullQueue[object] = ZmqPullQueue(addrs.detokenizer, WIRE)
    front_in: ZmqPullQueue[object] = ZmqPullQueue(addrs.frontend, WIRE)
    loop = SchedulerLoop(sched, addrs, rank=0)  # type: ignore[arg-type]
    to_sched: ZmqPushQueue[object] = ZmqPushQueue(addrs.recv, WIRE)
    try:
        facts = DetokFacts(1, tok.encode("A:").ids, ["zz"])
        to_sched.put(TokenizedMsg(1, [5, 6], facts=facts))
        to_sched.put(TokenizedMsg(2, list(range(9))))  # refused: too big for the pool
        assert loop.recv.poll(5000)
        loop.run_once()  # admits request 1 and runs its first step in the same iteration
        msg = detok_in.get()
        assert isinstance(msg, TokenOutMsg)
        assert msg.new == [facts] and [o.rid for o in msg.outs] == [1]
        err = front_in.get()
        assert isinstance(err, ErrorMsg) and err.rid == 2 and "pool" in err.message
        loop.run_once()
        last = detok_in.get()
        assert isinstance(last, TokenOutMsg) and last.new == [] and last.outs[0].finish_reason == "length"
        # The detokenizer needs nothing else: both messages decode in arrival order.
        detok = IncrementalDetokenizer(lambda seqs: tok.decode_batch(seqs))
        deltas = detok.handle(msg).deltas + detok.handle(last).deltas
        assert "".join(d.text for d in deltas) == "hi" and detok.states == {}
    finally:
        for q in (to_sched, detok_in, front_in):
            q.close()
        loop.close()


def test_stop_string_abort_goes_straight_to_the_replica(ipc, tok, tmp_path):
    from minisgl.tokenizer.detokenizer import DetokenizerAddrs, run_detokenizer

    tok.save(str(tmp_path / "tokenizer.json"))
    replicas = [ZmqPullQueue[object](ipc.addr(f"sched-{i}"), WIRE) for i in range(2)]
    front: ZmqPullQueue[object] = ZmqPullQueue(ipc.addr("front"), WIRE)
    addrs = DetokenizerAddrs(ipc.addr("detok"), tuple(q.addr for q in replicas), front.addr)
    parent, child = mp.Pipe(duplex=False)
    worker = threading.Thread(target=run_detokenizer, args=(str(tmp_path), addrs, ReadyReporter(child)), daemon=True)
    worker.start()
    assert parent.poll(30) and parent.recv()[0] == "ready"
    to_detok: ZmqPushQueue[object] = ZmqPushQueue(addrs.recv, WIRE)
    try:
        ids = tok.encode("ok STOP more").ids
        to_detok.put(TokenOutMsg([TokenOut(7, ids, None, 2, 0, len(ids))], [DetokFacts(7, [], ["STOP"], replica=1)]))
        abort = replicas[1].get()
        assert abort == AbortMsg(7)
        assert not replicas[0].poll(200)  # replica 0 holds nothing of it
        reply = front.get()
        assert isinstance(reply, TextDeltaMsg)
        delta = reply.deltas[0]
        assert (delta.text, delta.finish_reason, delta.stop_reason) == ("ok ", "stop", "STOP")
        # the scheduler's own final output after the abort is swallowed
        to_detok.put(TokenOutMsg([TokenOut(7, [], "abort", 2, 0, len(ids))]))
        assert not front.poll(300)
    finally:
        to_detok.put(ShutdownMsg())
        worker.join(10)
        for q in (*replicas, front, to_detok):
            q.close()
    assert not worker.is_alive()
