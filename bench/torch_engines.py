"""The torch-cuda engine's candidates side by side, on a GPU (issue #34):

* (a) ``aoti-dynamic``: AOTInductor, one dynamic batch dimension (what ``yolopipe build-engine``
  builds); ``aoti-fixed``: the same for one fixed batch;
* (b) ``precompiled``: ``torch.compile`` compiled ahead (``aot_compile`` of a compiled function,
  ``save_compiled_function``) and loaded without Dynamo (``torch.compiler.load_compiled_function``);
* (c) ``inductor``: ``torch.compile`` at start-up with Dynamo tracing, once with empty compiler
  caches and once with the caches the first left (what ``save_cache_artifacts`` carries);
* (d) ``eager``: the eager model (what the pipeline captures in CUDA graphs).

Each start also runs one fixed batch of letterboxed photos (``--images``, else noise) and records
its largest difference from the eager model's head on the same input (boxes in pixels, scores).

For each, in fresh processes (children of this script): the build (AOTInductor: one process
with an empty inductor cache, so every kernel is compiled), then a start (``torch.compile``:
once with an empty cache, once with the cache the first left, as every later start finds it):
the seconds from the process start to the first forward done (that includes cuDNN autotuning
the new shapes; one start of the dynamic package runs without it), and the engine's throughput
at ``--batch`` (and at batch 1): its forward captured alone in a CUDA graph and replayed, GPU
time by CUDA events over ``--iters`` replays. The packages are built into a scratch copy of the
model's folder, so nothing a user's runs find is touched.

    python bench/torch_engines.py --batch 64 --out bench/results/DATE-MACHINE-torch-engines.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from app.benchmark.machine import machine_info, versions

REF_BATCH = 8  # photos in the batch each variant's difference from the eager model is taken on


def child(args: argparse.Namespace) -> dict:
    """One engine in this (fresh) process: build it, or start it and time it."""
    from app.artifacts.exports import load_export

    model_dir = Path(args.model_dir)
    _, meta = load_export(model_dir)
    if args.child == "build":
        from app.builder.torch_build import build_torch_engine, engine_key

        key = engine_key(meta, precision=args.precision, max_batch=args.max_batch, min_batch=args.min_batch)
        started = time.perf_counter()
        path = build_torch_engine(model_dir, meta, key, say=lambda text: print(text, file=sys.stderr, flush=True))
        return {"build_s": round(time.perf_counter() - started, 1), "package": path.name,
                "package_mb": round(path.stat().st_size / 2**20, 1), "key": dataclasses.asdict(key)}
    import torch

    from app.backends.torch_cuda import TorchCudaEngine

    if args.child in ("precompile", "precompiled"):
        return precompiled_child(args, model_dir, meta)
    packages = []
    if args.child == "aoti":
        from app.artifacts.torch_engines import manifest_path, package_path
        from app.builder.torch_build import engine_key

        for lo, hi in args.ranges:
            key = engine_key(meta, precision=args.precision, max_batch=hi, min_batch=lo)
            assert manifest_path(model_dir, key).is_file(), f"no package built for batches {lo}-{hi}"
            packages.append((package_path(model_dir, key), key))
    t0 = time.perf_counter()
    engine = TorchCudaEngine(model_dir, meta, precision=args.precision, max_batch=args.batch,
                             compile=args.child == "inductor", packages=packages,
                             cudnn_benchmark=not args.no_cudnn_benchmark)
    t_loaded = time.perf_counter()
    dtype = torch.float16 if args.precision == "fp16" else torch.float32
    out: dict = {"engine": engine.compiler, "cudnn_benchmark": engine.cudnn_benchmark,
                 "load_s": round(t_loaded - t0, 3)}
    out.update(compare_with_eager(engine.forward, args, engine.device, dtype, save=args.child == "eager"))
    out.update(throughput(engine.forward, args, engine.device, dtype, meta.imgsz))
    engine.close()
    return out


def reference_input(args: argparse.Namespace, imgsz: int):
    """The batch every variant runs for its difference from the eager model: letterboxed photos."""
    import numpy as np

    from app.imaging.letterbox import letterbox, to_input

    images = []
    if args.images:
        import cv2

        for path in sorted(Path(args.images).glob("*.jpg"))[:REF_BATCH]:
            images.append(letterbox(cv2.imread(str(path)), imgsz)[0])
    rng = np.random.default_rng(0)
    while len(images) < REF_BATCH:
        images.append(rng.integers(0, 256, (imgsz, imgsz, 3), dtype=np.uint8))
    return to_input(images)


def compare_with_eager(forward, args: argparse.Namespace, device, dtype, *, save: bool) -> dict:
    """Run the reference batch, the process's first forward (timed: compile, autotune, kernel
    loading); the eager child saves its head, the others compare with it."""
    import torch

    from app.types import process_age_s

    ref_path = Path(args.model_dir).parent / "eager-reference.pt"
    x = torch.from_numpy(reference_input(args, args.imgsz)).to(device, dtype)
    smallest = min((lo for lo, _ in args.ranges), default=1)  # a fixed-batch package takes only its batch
    if smallest > x.shape[0]:
        x = x.repeat((smallest + x.shape[0] - 1) // x.shape[0], 1, 1, 1)[:smallest]
    first = time.perf_counter()
    with torch.inference_mode():
        head = forward(x.contiguous()).float()[:REF_BATCH].cpu()
        torch.cuda.synchronize(device)
    timed = {"first_forward_s": round(time.perf_counter() - first, 3),
             "process_to_first_forward_s": round(process_age_s() or 0.0, 3)}
    if save:
        torch.save(head, ref_path)
        return timed
    if not ref_path.is_file():
        return {**timed, "max_diff_vs_eager": "no eager reference (run the eager variant first)"}
    diff = (head - torch.load(ref_path)).abs()
    return {**timed, "max_diff_vs_eager": {"boxes_px": round(diff[:, :4].max().item(), 4),
                                           "scores": round(diff[:, 4:].max().item(), 5)}}


def throughput(forward, args: argparse.Namespace, device, dtype, imgsz: int) -> dict:
    """The forward captured alone in a CUDA graph and replayed, per batch of ``args.measure``."""
    import torch

    rows: dict = {}
    for batch in args.measure:
        x = torch.rand((batch, 3, imgsz, imgsz), generator=torch.Generator().manual_seed(0))
        x = x.to(device, dtype).contiguous()
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(4):
                forward(x)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                forward(x)
            stream.synchronize()
            ms = []
            for _ in range(args.iters):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(stream)
                graph.replay()
                e1.record(stream)
                e1.synchronize()
                ms.append(e0.elapsed_time(e1))
        graph.reset()
        p50 = statistics.median(ms)
        rows[f"b{batch}"] = {"gpu_ms_p50": round(p50, 4), "img_per_s": round(batch / p50 * 1e3, 1),
                             "gpu_ms_min": round(min(ms), 4)}
    return rows


def precompiled_child(args: argparse.Namespace, model_dir: Path, meta) -> dict:
    """(b): ``precompile`` compiles the model's forward ahead (Dynamo once, here) and saves it;
    ``precompiled`` loads it in a fresh process without Dynamo tracing and runs it."""
    import torch

    from app.gpu.torch_model import load_model

    saved = model_dir.parent / "precompiled.bin"
    dtype = torch.float16 if args.precision == "fp16" else torch.float32
    device = torch.device("cuda", 0)
    t0 = time.perf_counter()
    model, _ = load_model(model_dir / "weights.pt", precision=args.precision, device=device, anchors_in_graph=True)

    def forward(images):
        return model(images)

    if args.child == "precompile":
        example = torch.rand((2, 3, meta.imgsz, meta.imgsz), device=device, dtype=dtype)
        torch._dynamo.mark_dynamic(example, 0, min=1, max=args.max_batch)
        with torch.inference_mode(False), torch.no_grad():
            compiled = torch.compile(forward, fullgraph=True).aot_compile(((example,), {}))
        compiled.save_compiled_function(str(saved))
        return {"build_s": round(time.perf_counter() - t0, 1), "saved_mb": round(saved.stat().st_size / 2**20, 1)}
    t_model = time.perf_counter()
    with open(saved, "rb") as fh:
        loaded = torch.compiler.load_compiled_function(fh)
    run = lambda images: loaded(images)
    out: dict = {"engine": "precompiled", "load_s": round(time.perf_counter() - t0, 3),
                 "model_load_s": round(t_model - t0, 3)}
    with torch.no_grad():
        out.update(compare_with_eager(run, args, device, dtype, save=False))
        out.update(throughput(run, args, device, dtype, meta.imgsz))
    return out


def run_child(kind: str, args: argparse.Namespace, model_dir: Path, env: dict, **extra) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--model-dir", str(model_dir),
           "--precision", args.precision, "--batch", str(args.batch), "--iters", str(args.iters),
           "--imgsz", str(args.imgsz), "--max-batch", str(args.max_batch)]
    if args.images:
        cmd += ["--images", str(args.images)]
    for name, value in extra.items():  # a list: the option's values (an empty one: a flag)
        cmd += [f"--{name.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout, check=False)
    wall = round(time.monotonic() - started, 2)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"process_wall_s": wall, "exit_code": proc.returncode, "log_tail": (proc.stderr + proc.stdout)[-2500:]}
    return {"process_wall_s": wall, **json.loads(lines[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default="sample")
    p.add_argument("--precision", default="fp16")
    p.add_argument("--batch", type=int, default=64, help="the throughput batch, and the fixed package's batch")
    p.add_argument("--max-batch", type=int, default=64, help="the dynamic package's largest batch")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--variants", default="eager,aoti-dynamic,aoti-fixed,precompiled,inductor",
                   help="the eager variant runs first when named: the others' differences are taken from it")
    p.add_argument("--images", type=Path, help="photos for the difference batch (else noise)")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--reuse", action="store_true", help="aoti-dynamic: start the package `yolopipe build-engine` "
                                                        "built (its manifest's build seconds) instead of building one")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--child", choices=("build", "aoti", "inductor", "eager", "precompile", "precompiled"),
                   help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--min-batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--ranges", type=lambda s: tuple(map(int, s.split("-"))), nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--measure", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--no-cudnn-benchmark", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    from app.builder.export import export_onnx

    exported = export_onnx(args.weights)
    scratch = Path(tempfile.mkdtemp(prefix="yolopipe-engines-"))
    model_dir = scratch / "model"
    shutil.copytree(exported.model_dir, model_dir, ignore=shutil.ignore_patterns("torch-cuda", "torch-cache", "*.engine"))
    reused = None
    if args.reuse:
        from app.artifacts.torch_engines import manifest_path, package_path
        from app.builder.torch_build import engine_key

        key = engine_key(exported.meta, precision=args.precision, max_batch=args.max_batch)
        (model_dir / "torch-cuda").mkdir()
        for path in (package_path(exported.model_dir, key), manifest_path(exported.model_dir, key)):
            shutil.copyfile(path, model_dir / "torch-cuda" / path.name)  # a missing one fails here, plainly
        reused = json.loads(manifest_path(model_dir, key).read_text())
    base_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                "YOLO_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    variants = args.variants.split(",")
    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    measure = sorted({1, 32, args.batch})
    plain = {"no_cudnn_benchmark": []}  # cuDNN as the product runs it: no autotuning (app.backends.torch_cuda)
    try:
        if "eager" in variants:  # first: its head on the photos is the reference of the others' differences
            add({"variant": "eager", "step": "start", **run_child("eager", args, model_dir, base_env, measure=measure,
                                                                  **plain)})
        for name, (lo, hi) in (("aoti-dynamic", (1, args.max_batch)), ("aoti-fixed", (args.batch, args.batch))):
            if name not in variants:
                continue
            cache = {**base_env, "TORCHINDUCTOR_CACHE_DIR": str(scratch / f"cache-{name}"),
                     "TRITON_CACHE_DIR": str(scratch / f"triton-{name}")}
            if name == "aoti-dynamic" and reused is not None:
                add({"variant": name, "step": "build: yolopipe build-engine's, from its manifest", "batches": f"{lo}-{hi}",
                     "build_s": reused["build_seconds"], "package_mb": round(reused["package_bytes"] / 2**20, 1),
                     "fresh_process": reused.get("builder", {}).get("fresh_process")})
            else:
                add({"variant": name, "step": "build (empty compiler caches)", "batches": f"{lo}-{hi}",
                     **run_child("build", args, model_dir, cache, min_batch=lo, max_batch=hi)})
            for start in (1, 2) if name == "aoti-dynamic" else (1,):
                add({"variant": name, "step": f"start {start}", "batches": f"{lo}-{hi}",
                     **run_child("aoti", args, model_dir, base_env, ranges=[f"{lo}-{hi}"],
                                 measure=measure if lo == 1 else [args.batch], **plain)})
        if "precompiled" in variants:
            cache = {**base_env, "TORCHINDUCTOR_CACHE_DIR": str(scratch / "cache-precompiled"),
                     "TRITON_CACHE_DIR": str(scratch / "triton-precompiled")}
            built = run_child("precompile", args, model_dir, cache)
            add({"variant": "precompiled", "step": "build (aot_compile, save_compiled_function)", **built})
            if "exit_code" not in built:
                add({"variant": "precompiled", "step": "start (load_compiled_function)",
                     **run_child("precompiled", args, model_dir, cache, measure=measure)})
        if "inductor" in variants:
            cache = {**base_env, "TORCHINDUCTOR_CACHE_DIR": str(scratch / "cache-inductor"),
                     "TRITON_CACHE_DIR": str(scratch / "triton-inductor")}
            for step in ("start, empty compiler caches", "start, the caches of the first start"):
                add({"variant": "inductor", "step": step, **run_child("inductor", args, model_dir, cache,
                                                                       measure=[args.batch], **plain)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    out = {"what": "bench/torch_engines.py (see its docstring)",
           "code_on_the_machine": os.environ.get("YOLOPIPE_CODE"),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": {**machine_info(gpu=True), "nproc": os.cpu_count()}, "versions": versions(),
           "code": commit or "unknown (no git here)",
           "config": {"precision": args.precision, "batch": args.batch, "max_batch": args.max_batch,
                      "iters": args.iters, "reuse": args.reuse}, "rows": rows}
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
