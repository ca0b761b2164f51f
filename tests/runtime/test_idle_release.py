"""IdleRelease: a recogniser's resource is let go once unused for its idle time, never while in
use, again after each reload, and its watcher keeps nothing alive."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from duplex_actors.audio.idle_release import IdleRelease

IDLE_S = 0.05


class Resource:
    """What a recogniser holds: loaded by a use, let go by ``release``."""

    def __init__(self, idle_s: float | None = IDLE_S) -> None:
        self.loaded = False
        self.released_at: list[float] = []
        self.idle = IdleRelease(idle_s, self.release, name=f"test-{id(self)}")

    def use(self, hold_s: float = 0.0) -> None:
        with self.idle.using():
            self.loaded = True
            time.sleep(hold_s)

    def release(self) -> bool:
        was, self.loaded = self.loaded, False
        self.released_at.append(time.monotonic())
        return was


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def watchers(resource: Resource) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"{resource.idle.name}-idle-release"]


def test_an_unused_resource_is_let_go_once_and_the_watcher_ends():
    resource = Resource()
    began = time.monotonic()
    resource.use()
    assert wait_for(lambda: resource.idle.releases == 1)
    assert not resource.loaded
    assert resource.released_at[0] - began >= IDLE_S  # not before its idle time
    assert wait_for(lambda: not watchers(resource))
    assert len(resource.released_at) == 1


def test_a_use_in_progress_is_never_released_under_it():
    resource = Resource()
    resource.use(hold_s=6 * IDLE_S)  # six idle times long: the watcher looks several times
    assert resource.released_at == []
    assert resource.loaded
    assert wait_for(lambda: resource.idle.releases == 1)


def test_a_use_after_a_release_loads_again_and_is_let_go_again():
    resource = Resource()
    resource.use()
    assert wait_for(lambda: resource.idle.releases == 1)
    resource.use()
    assert resource.loaded
    assert wait_for(lambda: resource.idle.releases == 2)
    assert not resource.loaded


def test_uses_closer_together_than_the_idle_time_keep_it():
    resource = Resource(idle_s=2.0)
    for _ in range(5):
        resource.use()
        time.sleep(0.05)
    assert resource.released_at == []
    assert resource.loaded


def test_a_release_that_let_nothing_go_is_not_counted():
    resource = Resource()
    with resource.idle.using():
        pass  # a use that loaded nothing (a refused turn)
    assert wait_for(lambda: len(resource.released_at) == 1)
    assert resource.idle.releases == 0


def test_closed_it_lets_nothing_go_and_its_watcher_ends():
    resource = Resource(idle_s=0.3)
    resource.use()
    resource.idle.close()
    assert wait_for(lambda: not watchers(resource))
    time.sleep(0.4)
    assert resource.released_at == []
    resource.use()  # a use after close starts no watcher
    assert not watchers(resource)


def test_without_an_idle_time_nothing_is_watched_or_let_go():
    resource = Resource(idle_s=None)
    resource.use()
    assert not watchers(resource)
    assert resource.loaded
    with pytest.raises(ValueError):
        IdleRelease(0.0, resource.release, name="test")


def test_the_watcher_does_not_keep_its_owner_alive():
    # The owner of a pool dropped without close() must still be collected, so that its
    # finaliser stops the pool's processes; a watcher waiting out the idle time holds it weakly.
    resource = Resource(idle_s=30.0)
    resource.use()
    assert watchers(resource)
    gone = weakref.ref(resource)
    del resource
    gc.collect()
    assert gone() is None
