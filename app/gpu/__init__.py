"""GPU code: kernels, decode, buffers, the staged pipeline. Importing the package loads
nothing heavy; it only sets, before any CUDA context exists, how many hardware work queues
the context gets.

Why: CUDA spreads a context's streams over ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues
(8 by default), and two streams on one queue run in submission order, as if they were one.
torch's stream pool and nvImageCodec's per-thread streams are dozens of streams, so a
decoder stream that lands on the engine's queue waits behind every graph queued there:
decode of batch N+1 could not start before the engine finished batch N
(bench/results/2026-12-01-nvidia-h200-issue16-run2-connections.json, -run1-probe.json).
32 is the most CUDA allows. A user's own setting wins, and a process whose CUDA context
already exists keeps its own.
"""

import os

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
