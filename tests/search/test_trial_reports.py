"""A Train report reaches Tune before the next one goes (and before `fit()` returns): a report left in
Tune's actor queue when the trial ends deadlocks Tune's function trainable (service/search/trial.py,
`report_callback`)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from service.search import trial


class FakeQueue:
    """The `empty` / `put` / `get` of `ray.util.queue.Queue(1)`, in one process."""

    def __init__(self) -> None:
        self.items: list[dict] = []

    def put(self, item: dict) -> None:
        self.items.append(item)

    def get(self) -> dict:
        return self.items.pop(0)

    def empty(self) -> bool:
        return not self.items


def test_waits_until_the_trial_takes_the_report_and_gives_up_after_its_timeout():
    queue = FakeQueue()
    queue.put({"step": 1.0})
    taker = threading.Timer(0.2, queue.get)
    taker.start()
    started = time.monotonic()
    assert trial.wait_until_taken(queue, timeout_s=5.0)
    assert 0.15 < time.monotonic() - started < 4.5  # when taken, not at the 5 s timeout
    queue.put({"step": 2.0})  # nobody takes it (Tune stopped the trial): the wait ends, not the run
    assert not trial.wait_until_taken(queue, timeout_s=0.1)


def test_the_report_callback_returns_only_once_its_report_is_taken(monkeypatch):
    import ray.tune.integration.ray_train as integration

    queue = FakeQueue()
    session = SimpleNamespace(_get_or_create_inter_actor_queue=lambda: queue)
    monkeypatch.setattr(integration, "_in_tune_session", lambda: True)
    monkeypatch.setattr(integration, "get_session", lambda: session)
    callback = trial.report_callback()
    taken: list[dict] = []
    taker = threading.Timer(0.2, lambda: taken.append(queue.get()))
    taker.start()
    started = time.monotonic()
    callback.after_report(None, [{"step": 3.0, "done": 1.0, "tokens_per_s": 10.0}], None)
    assert time.monotonic() - started > 0.15 and queue.empty()
    assert taken == [{"step": 3.0, "last_step": 1.0, "tokens_per_s": 10.0}]  # `done` renamed for Tune
