"""The inference worker's metrics: a batch of observations counts as each one observed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from app.ipc.metrics import LATENCY_BUCKETS
from app.service.inference.metrics import observe_many


def _samples(registry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def _histogram():
    registry = CollectorRegistry()
    return registry, Histogram("stage_seconds", "test", ["stage"], buckets=LATENCY_BUCKETS, registry=registry)


def test_observing_many_at_once_gives_the_histogram_of_observing_each():
    values = [0.0, 0.0005, 0.00051, 0.003, 0.003, 0.7, 29.0, 31.0, 1e4, 0.02]  # bucket edges, inside and past all
    one_by_one, h1 = _histogram()
    for v in values:
        h1.labels("queue").observe(v)
    together, h2 = _histogram()
    observe_many(h2.labels("queue"), values[:4])
    observe_many(h2.labels("queue"), [])
    observe_many(h2.labels("queue"), values[4:])
    assert _samples(together) == _samples(one_by_one)
    assert 'stage_seconds_count{stage="queue"} 10.0' in _samples(together)
