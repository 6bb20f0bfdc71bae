"""A batch's answers as the inference worker sends them (``app.ipc.answers.Answers``), and each
owner's share: ``Detector.run``'s arrays with each image's request, index and waits; an HTTP
worker's share as one RESULTS frame, a share of this process's own (the stream host's frames,
``take_answers``) as arrays, never encoded."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from app.contracts import DetectedBatch
from app.ipc.answers import RECORD, Answers, answers_frame


def answers_of(jobs: Sequence[Any], start: float, detected: DetectedBatch,
               timings: dict[str, float] | None = None) -> Answers:
    """``jobs``' answers (``app.service.inference.batcher.Job``, in order) from the detector's:
    each image's request and index, how long it waited (from admission to ``start``) and
    decoded, then its size and rows or its error; ``timings``: the batch's stage times (ms)."""
    records = np.zeros(len(jobs), RECORD)
    records["req_id"] = [j.ref.req_id for j in jobs]
    records["index"] = [j.ref.index for j in jobs]
    records["decode_ms"] = [j.decode_ms for j in jobs]
    records["queue_ms"] = [(start - j.admitted_at) * 1e3 for j in jobs]
    records["ok"] = 1
    if detected.errors:
        records["ok"][list(detected.errors)] = 0
    records["width"] = detected.widths
    records["height"] = detected.heights
    records["rows"] = detected.counts
    return Answers(records, detected.rows, detected.errors, timings or {})


def answer_frames(jobs: Sequence[Any], answers: Answers) -> list[tuple[Any, bytes]]:
    """(owner, RESULTS frame) per owner of ``jobs`` that is another process (an HTTP worker's
    connection), whose answers ``answers`` holds in order. An owner in this process (one with
    ``take_answers``) takes its share here, as arrays."""
    by_owner: dict[Any, list[int]] = {}
    for i, job in enumerate(jobs):
        by_owner.setdefault(job.owner, []).append(i)
    shares = [answers] if len(by_owner) == 1 else answers.split(list(by_owner.values()))
    frames = []
    timings: bytes | None = None
    for owner, share in zip(by_owner, shares):
        take = getattr(owner, "take_answers", None)
        if take is not None:
            take(share)
            continue
        if timings is None and len(by_owner) > 1:  # the batch's timings, encoded once for every owner
            timings = json.dumps(answers.timings).encode()
        frames.append((owner, answers_frame(share, timings)))
    return frames
