"""The serving processes: a supervisor, HTTP workers, and one inference worker per GPU.

``supervisor`` (starts and stops them all), ``http_worker`` (an HTTP worker process),
``pool`` (starting and restarting inference workers, with warm standbys), ``processes``
(what every process sets up), and ``inference`` (the inference worker: its process entry,
batcher, warm-up, answers, metrics and video streams). What travels between them is
``app.ipc``'s (wire format, rings, run folder layout, the HTTP workers' clients).
"""
