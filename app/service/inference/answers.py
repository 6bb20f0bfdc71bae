"""A batch's answers as the inference worker sends them (``app.ipc.answers.Answers``: the
detector's arrays with a ticket per image), and each owner's share: an HTTP or gRPC worker's as
one RESULTS frame, a share of this process's own (the stream host's frames, ``take_answers``)
as arrays, never encoded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.contracts import DetectedBatch
from app.ipc.answers import Answers, answers_frame, tickets


def answers_of(jobs: Sequence[Any], start: float, detected: DetectedBatch, batch_ms: float = 0.0) -> Answers:
    """``jobs``' answers (``app.service.inference.batcher.Job``, in order) from the detector's:
    each image's ticket (its request and index, how long it decoded and waited, from admission
    to ``start``, and the batch's times: ``batch_ms`` and the detector's stage times)."""
    refs = [j.ref for j in jobs]
    return Answers(detected, tickets([r.req_id for r in refs], [r.index for r in refs], [j.decode_ms for j in jobs],
                                     [(start - j.admitted_at) * 1e3 for j in jobs], batch_ms, detected.timings))


def failed_answers(jobs: Sequence[Any], errors: Sequence[Any]) -> Answers:
    """``jobs`` answered with ``errors`` (one each), never run."""
    return Answers.failed([j.ref.req_id for j in jobs], [j.ref.index for j in jobs], errors)


def answer_frames(jobs: Sequence[Any], answers: Answers) -> list[tuple[Any, bytes]]:
    """(owner, RESULTS frame) per owner of ``jobs`` that is another process (an HTTP or gRPC
    worker's connection), whose answers ``answers`` holds in order. An owner in this process
    (one with ``take_answers``) takes its share here, as arrays."""
    by_owner: dict[Any, list[int]] = {}
    for i, job in enumerate(jobs):
        by_owner.setdefault(job.owner, []).append(i)
    shares = [answers] if len(by_owner) == 1 else answers.split(list(by_owner.values()))
    frames = []
    for owner, share in zip(by_owner, shares):
        take = getattr(owner, "take_answers", None)
        if take is not None:
            take(share)
        else:
            frames.append((owner, answers_frame(share)))
    return frames
