"""The serving processes: a supervisor, HTTP workers, and one inference worker per GPU.

``settings`` (what serving adds to ``app.config.Settings``), ``wire`` (the frames between the
processes), ``ring`` (shared memory for image bytes), ``batcher`` (admission in time and
dynamic batching), ``worker`` (the inference worker process), ``pool`` (starting and
restarting inference workers), ``client`` (an HTTP worker's side), ``supervisor``.
"""
