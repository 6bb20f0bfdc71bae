"""The inference worker: one process per GPU (or per CPU worker) that owns the detector.

``worker`` (the process entry and its serving loop), ``batcher`` (admission in time and
dynamic batching into ``Detector.run``), ``warmup`` (before serving; telling a lost device
context from a failed batch), ``answers`` (a batch's answers as ``app.ipc.answers.Answers``,
each owner's share), ``metrics`` (its Prometheus families) and ``streams`` (``/v1/streams``'
video streams, their frames in the batcher's batches).
"""
