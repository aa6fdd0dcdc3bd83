"""Engine events reach the asyncio loop in order, batched into one wake-up per burst."""

from __future__ import annotations

import asyncio
import threading

from engine.request_events import RequestEvents
from engine.sequence import SeqEvent


def test_a_burst_from_the_engine_thread_arrives_in_order_with_one_wake_up():
    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(*args, **kw):
            nonlocal wakeups
            wakeups += 1
            return real(*args, **kw)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        streams = [RequestEvents() for _ in range(8)]
        gate = threading.Event()

        def engine_step() -> None:  # one step: every request gets a token, then each finishes
            gate.wait()
            for tok in range(3):
                for i, s in enumerate(streams):
                    s.listener(SeqEvent(i, [tok], str(tok), tok == 2, "length" if tok == 2 else None))

        t = threading.Thread(target=engine_step)
        t.start()
        gate.set()
        t.join()  # every event pushed before the loop runs again: one batch
        got = []
        for s in streams:
            toks = []
            while True:
                ev = await s.next()
                assert ev.seq_id == streams.index(s)  # only this request's events reach its queue
                toks.extend(ev.new_token_ids)
                if ev.finished:
                    break
            got.append(toks)
        return got, wakeups

    got, wakeups = asyncio.run(main())
    assert got == [[0, 1, 2]] * 8
    assert wakeups == 1


def test_events_after_the_loop_closed_are_dropped():
    async def make() -> RequestEvents:
        return RequestEvents()

    events = asyncio.run(make())
    events.listener(SeqEvent(0, [1], "a", False, None))  # no error, nothing to deliver to
    events.listener(SeqEvent(0, [2], "b", True, "stop"))
