"""What a client's frame is billed for: its thread's CPU time, collections excepted."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from duplex_actors.server import frame_cost


@pytest.fixture
def timed_collections():
    frame_cost.install()
    yield
    frame_cost.uninstall()


@pytest.fixture
def big_heap():
    # ~600 k tracked objects: a full collection over them takes tens of milliseconds.
    heap = [[i] for i in range(600_000)]
    yield heap
    del heap


def spin_cpu(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_work_on_the_thread_is_billed():
    start = frame_cost.mark()
    spin_cpu(0.05)
    assert frame_cost.billed_since(start) >= 0.05


def test_waiting_is_not_billed():
    # What a frame's thread spends waiting (for the GIL, for a core) is not its work.
    start = frame_cost.mark()
    time.sleep(0.2)
    assert frame_cost.billed_since(start) < 0.05


#: A collection this long is told apart from the frame's own work (and the clocks' grain).
LONG_COLLECTION_S = 0.02
LONG_YOUNG_COLLECTION_S = 0.002


@pytest.mark.slow
def test_a_collection_during_the_frame_is_not_billed(timed_collections, big_heap):
    # The heap grows until a full collection is long enough to tell: how long a given heap
    # takes depends on the host (a faster one needs more objects).
    for _ in range(5):
        start = frame_cost.mark()
        began = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - began
        if took > LONG_COLLECTION_S:
            break
        big_heap.extend([i] for i in range(len(big_heap)))
    spin_cpu(0.01)
    billed = frame_cost.billed_since(start)
    assert took > LONG_COLLECTION_S, "the heap is too small to tell a collection from the frame's work"
    assert 0.01 <= billed < 0.01 + took / 4


def test_a_young_collection_is_billed_to_the_frame_that_set_it_off(timed_collections):
    # A young collection walks what was allocated lately, mostly by the frame itself: a frame
    # of many tiny values must not make its own collections free.
    # Doubled until the collection is long enough to tell, however fast the host.
    gc.disable()  # so that they are still young when collected
    try:
        for count in (200_000 << k for k in range(5)):
            young = [[i] for i in range(count)]
            start = frame_cost.mark()
            began = time.thread_time()
            gc.collect(0)
            took = time.thread_time() - began
            billed = frame_cost.billed_since(start)
            del young
            if took > LONG_YOUNG_COLLECTION_S:
                break
    finally:
        gc.enable()
    assert took > LONG_YOUNG_COLLECTION_S, "too few young objects to tell"
    assert billed >= 0.9 * took


def test_a_collection_on_another_thread_is_not_taken_off_this_ones_bill(timed_collections, big_heap):
    # The collector's time is kept per thread: another thread's collection did not run on this
    # one, so subtracting it would let this thread's own work go unbilled.
    start = frame_cost.mark()
    other = threading.Thread(target=gc.collect)
    other.start()
    other.join()
    spin_cpu(0.05)
    assert frame_cost.billed_since(start) >= 0.05


def test_without_install_collections_are_billed_as_cpu(big_heap):
    # Only a running server times collections; a bare mark still measures the thread.
    start = frame_cost.mark()
    gc.collect()
    assert frame_cost.billed_since(start) > 0.0


def test_install_is_shared_and_the_last_uninstall_removes_the_callback():
    before = list(gc.callbacks)
    frame_cost.install()
    frame_cost.install()
    frame_cost.uninstall()
    assert len(gc.callbacks) == len(before) + 1
    frame_cost.uninstall()
    frame_cost.uninstall()  # one too many does not remove someone else's callback
    assert gc.callbacks == before
