"""One OpenMP team per process (engine.threads): helper threads never form one, the thread that
loads a model or starts the engine gives its team back."""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.threads import _gomp, release_team, single_threaded
from tests.engine_fixtures import make_tiny_model


def _comm(tid: int | str) -> str | None:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:  # the thread exited meanwhile
        return None


def os_threads() -> set[int]:
    """This process's OS thread ids whose name is the calling thread's. :func:`on_thread` gives its
    thread a name of its own, which the threads it starts (its OpenMP team) inherit and other
    tests' leftover threads do not have; still, compare sets, not counts."""
    me = _comm(threading.get_native_id())
    return {int(t) for t in os.listdir("/proc/self/task") if _comm(t) == me}


def parallel_op() -> None:
    """An op torch runs as a parallel region (far above its grain size)."""
    x = torch.ones(1 << 22)
    x.mul_(1.5).add_(1.0)


def wait_for(cond: Callable[[], bool], timeout: float = 2.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


_names = itertools.count()


def _name_this_thread(name: str) -> None:
    """The OS name of the calling thread (``prctl(PR_SET_NAME)``; at most 15 bytes)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(15, name.encode()[:15], 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NAME) failed")


def on_thread(fn: Callable[[], Any]) -> Any:
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _name_this_thread(f"lp-team-{next(_names)}")
            out.append(fn())
        except BaseException as e:  # re-raised on the test thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """Two compute threads whatever this machine has, so a parallel op forms a team."""
    if _gomp() is None:
        pytest.fail("libgomp is not loaded: torch's CPU build on Linux runs on it")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_parallel_op_forms_a_team_that_outlives_it() -> None:
    """The premise: without help, a thread's parallel op leaves pool threads behind."""
    def body() -> int:
        base = os_threads()
        parallel_op()
        return len(os_threads() - base)

    assert on_thread(body) >= 1


def test_release_team_lets_the_pool_threads_exit() -> None:
    def body() -> tuple[int, bool]:
        base = os_threads()
        parallel_op()
        pool = os_threads() - base
        assert release_team()
        # The new threads are the team's and any that another test's leftovers started meanwhile
        # (one such made "all of them exit" fail once): the team's must go.
        return len(pool), wait_for(lambda: len(pool & os_threads()) <= len(pool) - (torch.get_num_threads() - 1))

    formed, gone = on_thread(body)
    assert formed >= 1 and gone


def test_single_threaded_helper_never_forms_a_team() -> None:
    def body() -> tuple[int, set[int], int]:
        single_threaded()
        base = os_threads()
        parallel_op()
        return torch.get_num_threads(), os_threads() - base, int(torch.ones(1 << 22).sum())

    n, new, total = on_thread(body)
    assert (n, new, total) == (1, set(), 1 << 22)
    # the process default is untouched: a fresh thread still gets two
    assert on_thread(torch.get_num_threads) == 2


def test_single_threaded_as_pool_initializer() -> None:
    with ThreadPoolExecutor(1, initializer=single_threaded) as pool:
        assert pool.submit(torch.get_num_threads).result() == 1
        base = os_threads()  # the pool's thread included
        pool.submit(parallel_op).result()
        assert not os_threads() - base


def test_loading_and_starting_the_engine_give_the_callers_team_back(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m")

    def body() -> tuple[bool, bool]:
        base = os_threads()
        eng = Engine.from_path(model, EngineConfig(kv_cache_bytes=8 << 20))
        load_left_none = wait_for(lambda: not os_threads() - base)  # loading's team is gone
        before = os_threads()
        parallel_op()  # this thread forms a team again
        pool = os_threads() - before
        assert pool
        eng.start()  # the engine thread starts; this thread's team goes
        try:
            return load_left_none, wait_for(lambda: not pool & os_threads())
        finally:
            eng.stop()

    load_left_none, released = on_thread(body)
    assert load_left_none and released
