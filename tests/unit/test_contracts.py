"""The contracts' own arithmetic: a pipeline run's stage times summed over runs and read out in
their order, as the metrics, tickets and ``/v1``'s timings take them."""

from __future__ import annotations

import dataclasses
import random

from app.contracts import StageTimes


def test_stage_times_add_field_by_field_and_read_out_in_field_order():
    rng = random.Random(0)
    for _ in range(200):
        a = StageTimes(*(rng.uniform(0, 50) for _ in dataclasses.fields(StageTimes)))
        b = StageTimes(*(rng.uniform(0, 50) for _ in dataclasses.fields(StageTimes)))
        assert a.values() == dataclasses.astuple(a)  # every field, in order (a new field must be added there)
        assert dataclasses.astuple(a + b) == tuple(x + y for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b)))
    assert StageTimes() + StageTimes() == StageTimes()
