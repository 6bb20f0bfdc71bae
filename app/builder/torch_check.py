"""Checks of a just-built AOTInductor package beyond its numbers (``app.builder.torch_build``'s
``check_package`` runs them): ``batch_variance``, that a batch-invariant package gives an image
the same bits alone and anywhere in larger batches; ``fresh_process_check``, that it loads and
runs in a new process, as every later run loads it (started with the build, handed the package
beside the other checks)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from app.artifacts.torch_engines import TorchEngineKey
from app.builder.child import child_env
from app.errors import BackendUnavailable
from app.types import ModelMeta


def batch_variance(runner: Any, example: Any, key: TorchEngineKey) -> list[str]:
    """Where ``runner`` gives one image other bits than it gives it alone: at the first and last
    place of batches of other sizes in the key's range, among random companions (empty: nowhere)."""
    import torch

    sizes = sorted({n for n in (2, 3, 8, 17, key.max_batch) if key.min_batch <= n <= key.max_batch})
    if key.min_batch > 1 or not sizes:
        return []
    probe = example[:1].contiguous()
    alone = runner(probe).clone()
    gen = torch.Generator().manual_seed(1)
    found = []
    for n in sizes:
        batch = torch.rand((n, *probe.shape[1:]), generator=gen).to(probe.device, probe.dtype)
        for place in sorted({0, n - 1}):
            batch[place] = probe[0]
            got = runner(batch.contiguous())[place]
            if not torch.equal(got, alone[0]):
                found.append(f"at place {place} of a batch of {n} (by up to {(got.float() - alone[0].float()).abs().max().item():.3g})")
            batch[place] = torch.rand(probe.shape[1:], generator=gen).to(probe.device, probe.dtype)
    return found


FRESH_CHECK_TIMEOUT_S = 300
# The fresh process imports what a run imports first, then waits for the package's path on its
# standard input (an empty line: nothing to check, it exits).
FRESH_CHECK = """
import json, sys, time
from pathlib import Path
import torch
from app.gpu.torch_model import load_package
path = sys.stdin.readline().strip()
if not path:
    sys.exit(0)
index, batch, size, dtype = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
device = torch.device("cuda", index)
started = time.perf_counter()
run = load_package(Path(path), device)
loaded = time.perf_counter()
with torch.inference_mode():
    out = run(torch.zeros((batch, 3, size, size), dtype=getattr(torch, dtype), device=device))
    torch.cuda.synchronize(device)
print(json.dumps({"shape": tuple(out.shape), "load_s": round(loaded - started, 3),
                  "first_run_s": round(time.perf_counter() - loaded, 3)}))
"""


class FreshProcess:
    """A new process that has imported what a run imports and waits for a package to load."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def load(self, path: Path) -> None:
        """Hand it ``path``: it loads the package and runs it now, beside the caller's own checks."""
        try:
            self.proc.stdin.write(f"{path}\n")
            self.proc.stdin.flush()  # left open: ``communicate`` closes it
        except OSError:  # it has already ended: its answer says how
            pass

    def answer(self) -> dict[str, float]:
        """Wait for it: the seconds it took to load the package (``load_s``, the CUDA context
        created before) and to run its first batch (``first_run_s``)."""
        return _fresh_answer(self.proc)


@contextlib.contextmanager
def fresh_process_check(index: int, key: TorchEngineKey, meta: ModelMeta) -> Iterator[FreshProcess]:
    """A new process for loading and running the package just built, as every later run does: a
    package that loads in the process that compiled it may still crash one that did not (seen on
    the H200). It starts when the block does, so that its imports (about 2 s, mostly torch:
    bench/results/2026-12-06-nvidia-h100-build-probe.json) run while the build exports and
    compiles; ``FreshProcess.load`` then hands it the package. A process not waited for is
    killed when the block ends."""
    env = child_env(PYTHONFAULTHANDLER="1")
    dtype = "float16" if key.precision == "fp16" else "float32"
    args = [str(index), str(key.min_batch), str(meta.imgsz), dtype]
    proc = subprocess.Popen([sys.executable, "-c", FRESH_CHECK, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        yield FreshProcess(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.communicate()


def _fresh_answer(proc: subprocess.Popen) -> dict[str, float]:
    try:
        stdout, stderr = proc.communicate(timeout=FRESH_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise BackendUnavailable("the AOTInductor package just built did not load in a fresh process within "
                                 f"{FRESH_CHECK_TIMEOUT_S} s") from exc
    if proc.returncode != 0:
        how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exit code {proc.returncode}")
        tail = " | ".join(line.strip() for line in stderr.strip().splitlines()[-12:])
        raise BackendUnavailable(f"the AOTInductor package just built does not run in a fresh process here "
                                 f"({how}): {tail}"[:1500])
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    timings = json.loads(lines[-1]) if lines else {}
    return {k: float(timings[k]) for k in ("load_s", "first_run_s") if k in timings}
