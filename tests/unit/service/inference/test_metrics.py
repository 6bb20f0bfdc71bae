"""The inference worker's metrics: a batch of observations counts as each one observed, also when
batches are held and written together."""

from __future__ import annotations

import math
from dataclasses import astuple

import numpy as np
import pytest

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from app.contracts import StageTimes
from app.ipc.metrics import LATENCY_BUCKETS
from app.service.inference.metrics import WorkerMetrics, observe_many


def _samples(registry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def _histogram():
    registry = CollectorRegistry()
    return registry, Histogram("stage_seconds", "test", ["stage"], buckets=LATENCY_BUCKETS, registry=registry)


@pytest.mark.parametrize("count", [10, 33, 500])  # counted in Python, just past it, in NumPy
@pytest.mark.parametrize("special", [False, True])
def test_observing_many_at_once_gives_the_histogram_of_observing_each(count, special):
    """Bucket edges, values inside and past every bound, few values (counted in Python) and many
    (in NumPy), and an infinity and a NaN (no bucket, its sum NaN, as ``observe`` leaves them)."""
    rng = np.random.default_rng(count)
    edges = [0.0, 0.0005, 0.00051, 0.003, 0.003, 0.7, 29.0, 31.0, 1e4, 0.02]
    values = [*edges, *(10.0 ** rng.uniform(-5, 2, count - len(edges)))][:count]
    if special:
        values[3:5] = [math.inf, math.nan]
    one_by_one, h1 = _histogram()
    for v in values:
        h1.labels("queue").observe(v)
    together, h2 = _histogram()
    observe_many(h2.labels("queue"), values[:4])
    observe_many(h2.labels("queue"), [])
    observe_many(h2.labels("queue"), values[4:])
    assert _samples(together) == _samples(one_by_one)
    assert f'stage_seconds_count{{stage="queue"}} {float(count - special)}' in _samples(together)


BATCHES = [  # queue and decode per image (s), batch size, the detector call (s), stage times (ms), ok, failed
    ([0.001, 0.003], [0.0005, 0.002], 2, 0.004, StageTimes(0.0, 1.0, 2.0, 0.5), 2, 0),
    ([0.02], [0.0], 0, 0.0001, StageTimes(), 0, 1),
    ([0.0004, 0.7, 0.05], [0.01, 0.01, 0.3], 3, 0.06, StageTimes(12.0, 3.0, 40.0, 1.5), 3, 0),
]


def test_batches_held_then_written_are_the_histograms_of_observing_each_value(monkeypatch):
    """``observe_batch`` holds a batch's observations (each written value costs a getpid and a
    write to the metrics file) and writes them together: when asked (``write``: the batcher has
    no admitted work left) or once ``WRITE_EVERY_S`` has passed; what it writes is each value
    observed alone."""
    monkeypatch.setattr("app.service.inference.metrics.WRITE_EVERY_S", 3600.0)
    held, each = WorkerMetrics("0"), WorkerMetrics("0")
    empty = _samples(held.registry)
    for queue, decode, size, batch_s, stages, ok, failed in BATCHES:
        for v in queue:
            each.stage("queue").observe(v)
        for v in decode:
            each.stage("decode").observe(v)
        each.batch_size.observe(size)
        each.stage("batch").observe(batch_s)
        for name, ms in zip(("pipeline_decode", "preprocess", "infer", "postprocess"), astuple(stages)):
            each.stage(name).observe(ms / 1e3)
        for outcome, n in (("ok", ok), ("failed", failed)):
            if n:
                each.images(outcome).inc(n)
    for queue, decode, size, batch_s, stages, ok, failed in BATCHES[:2]:
        held.observe_batch(queue, decode, size, batch_s, stages, ok, failed)
    assert _samples(held.registry) == empty  # held: not written yet
    held.observe_batch(*BATCHES[2])
    assert _samples(held.registry) == empty
    held.write()
    assert _samples(held.registry) == _samples(each.registry)
    assert 'yolopipe_stage_latency_seconds_count{stage="queue"} 6.0' in _samples(held.registry)
    assert 'yolopipe_batch_size_count 3.0' in _samples(held.registry)
    held.write()  # nothing held: nothing changes
    assert _samples(held.registry) == _samples(each.registry)


def test_a_batch_observed_after_the_interval_is_written_with_those_held(monkeypatch):
    monkeypatch.setattr("app.service.inference.metrics.WRITE_EVERY_S", 3600.0)
    metrics = WorkerMetrics("0")
    metrics.observe_batch(*BATCHES[0])
    assert "yolopipe_batch_size_count 0.0" in _samples(metrics.registry)
    monkeypatch.setattr("app.service.inference.metrics.WRITE_EVERY_S", 0.0)
    metrics.observe_batch(*BATCHES[1])
    assert "yolopipe_batch_size_count 2.0" in _samples(metrics.registry)
