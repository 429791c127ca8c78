"""worker.handoff: the loop's batched hand-offs to worker threads and from the engine thread."""
from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import Future

import pytest

from worker.handoff import Aborted, EngineWaits, Offload


def test_offload_runs_one_iterations_calls_on_its_thread_hands_each_its_own_outcome_and_closes():
    async def body():
        offload = Offload()
        threads: list[int] = []

        def work(i: int) -> int:
            threads.append(threading.get_ident())
            if i == 3:
                raise ValueError("three")
            return i * i

        futures = [offload.call(lambda i=i: work(i)) for i in range(6)]
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        assert outcomes[:3] == [0, 1, 4] and outcomes[4:] == [16, 25]
        assert isinstance(outcomes[3], ValueError) and str(outcomes[3]) == "three"
        assert len(set(threads)) == 1 and threads[0] != threading.get_ident()  # one batch, off the loop

        blocker = threading.Event()
        heavy = offload.call(lambda: blocker.wait(5), heavy=True)  # its own thread: the next batch passes it
        assert await offload.call(lambda: "small") == "small"
        assert not heavy.done()
        blocker.set()
        assert await heavy is True
        (offload_thread,) = [t for t in threading.enumerate() if t.ident == threads[0]]
        offload.close()
        offload_thread.join(5)
        assert not offload_thread.is_alive()
    asyncio.run(body())


def test_offload_runs_each_call_in_its_callers_context():
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    async def body():
        offload = Offload()

        async def one(value: str) -> str:
            var.set(value)  # each task has its own context, as each job's log bindings
            return await offload.call(var.get)
        assert await asyncio.gather(one("a"), one("b")) == ["a", "b"]
    asyncio.run(body())


def test_engine_waits_deliver_many_results_in_one_wakeup_and_raise_what_the_engine_raised():
    async def body():
        waits = EngineWaits()
        loop = asyncio.get_running_loop()
        wakeups = 0
        deliver = waits._deliver

        def counting_deliver() -> None:
            nonlocal wakeups
            wakeups += 1
            deliver()
        waits._deliver = counting_deliver
        futures: list[Future] = [Future() for _ in range(50)]
        tasks = [loop.create_task(waits.wait(f)) for f in futures]
        await asyncio.sleep(0)  # every wait registered

        def engine_step() -> None:  # one step finishes them all, on another thread
            for i, f in enumerate(futures):
                if i == 7:
                    f.set_exception(RuntimeError("engine said no"))
                else:
                    f.set_result(i)
        threading.Thread(target=engine_step).start()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert [o for i, o in enumerate(outcomes) if i != 7] == [i for i in range(50) if i != 7]
        assert isinstance(outcomes[7], RuntimeError)
        assert 1 <= wakeups < 50
    asyncio.run(body())


def test_engine_waits_abort_all_ends_every_wait_now_and_later():
    async def body():
        waits = EngineWaits()
        pending = asyncio.ensure_future(waits.wait(Future()))
        await asyncio.sleep(0)
        waits.abort_all()
        with pytest.raises(Aborted):
            await pending
        with pytest.raises(Aborted):
            await waits.wait(Future())
    asyncio.run(body())
