"""The default engine's kernels against cuDNN's, on the GPU (issue #45, goal 3): packages replayed
in CUDA graphs, rounds alternating, and where each one's device time goes.

Runners, each a package's callable ``images → head`` (the eager Ultralytics model is not one:
its head makes its anchors on the host, which a CUDA graph cannot capture):

* ``default``: the default engine (torch-cuda fp16, batch 1-64, batch-invariant kernels) as
  ``build-engine`` built it, built now from the tuning cache if absent;
* ``cudnn`` (``--cudnn``): the cuDNN package (``--no-batch-invariant``), built if absent (about
  100 s);
* variants (``--variant NAME``): the default engine built in this process only, into a folder
  and tuning cache of its own, with one of its build steps undone, to measure that step against,
  or one step more, to measure it before it lands:

  - ``as-trained-stem``: the stem as trained, the 3x3 stride-2 convolution of the 3-channel image,
    not rewritten as a 2x2 convolution of the image's space-to-depth (``app.builder.stem_rewrite``);
  - ``as-trained-pools``: SPPF's max pools as trained, not rewritten as separable maxima
    (``app.builder.pool_rewrite``);
  - ``benchmarked-epilogues``: a template's pointwise epilogue fused only where inductor's one
    timing of the fused kernel won (``benchmark_epilogue_fusion``, inductor's default);
  - ``unaggressive-fusion``: without ``aggressive_fusion`` (inductor's default), so an epilogue
    that inductor finds shares "no data" with its template runs as a kernel of its own
    (``app.builder.inductor_settings``);
  - ``pointwise-cat`` (one more): every concatenation a pointwise kernel of its own
    (``force_pointwise_cat``) instead of a buffer its inputs' producers write into, so that no
    convolution's bias and SiLU epilogue writes into a concatenation's buffer, which inductor
    refuses to fuse into a template ("template epilogue not satisfied": the C2f blocks'), and a
    1x1 convolution (a matrix product in inductor) may load its concatenated input itself
    (prologue fusion);
  - ``epilogues-first`` (one more): epilogues fused into their templates before any other fusion
    (``epilogue_fusion_first``), so that a SiLU is not first fused into the kernel that copies
    it elsewhere;
  - ``realized-cat-inputs`` (one more): every input of a concatenation computed into a buffer of
    its own before the concatenation is lowered (inductor's ``aten.cat`` lowering wrapped for the
    build), so that a SiLU is its convolution's epilogue instead of being computed inside the
    concatenation's copy (where, needing fp32, it keeps the copy from being a 1x1
    convolution's prologue) and again for its other reader. Alone, inductor may still have the
    realized inputs write into the concatenation's buffer (and refuse them as epilogues there);
    ``realized-cat-inputs+pointwise-cat`` makes the concatenation a plain fp16 copy instead.

  Several joined by ``+`` change several steps.
  A variant's tuning cache starts as a copy of ``--seed NAME=FILE`` where given (a cache of its
  graph makes its build a short one); otherwise its build is a first build (about a minute on
  the H100).

Rows: img/s per round at each of ``--batches``, the runners' order turned by one each round (the
device's time of ``--replays``-sized runs of graph replays, by CUDA events) and their medians; each runner's head at the largest batch against
``default``'s (boxes in pixels, scores) and whether its smaller batches give the largest one's
rows bit for bit; then torch's profiler at the smallest and largest batch (no graph): device time
per forward by kernel and by kind (Triton template, pointwise, reduction, cuDNN convolution,
other), and launches per forward.

    python bench/kernel_ab.py --cudnn --variant as-trained-pools --seed as-trained-pools=bench/tuning/CARD.json \
        --out /tmp/out/kernel-ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from app.benchmark.machine import code_revision, machine_info, versions

KINDS = (("template", ("triton_tem",)), ("pointwise", ("triton_poi",)), ("reduction", ("triton_red", "triton_per")),
         ("cudnn convolution", ("conv", "xmma", "cudnn", "implicit", "fprop")), ("gemm", ("gemm", "cutlass")))


# Each variant: the default build with one step undone or one more, as (functions of
# app.builder.torch_build replaced, inductor settings replaced).
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "as-trained-stem": ({"rewrite_stem": lambda model, imgsz: False}, {}),
    "as-trained-pools": ({"rewrite_pools": lambda model: 0}, {}),
    "benchmarked-epilogues": ({}, {"benchmark_epilogue_fusion": True}),
    "unaggressive-fusion": ({}, {"aggressive_fusion": False}),
    "pointwise-cat": ({}, {"force_pointwise_cat": True}),
    "epilogues-first": ({}, {"epilogue_fusion_first": True}),
    "realized-cat-inputs": ({"compile_package": lambda *args, **kwargs: compiled_with_realized_cat_inputs(*args,
                                                                                                        **kwargs)}, {}),
}


def compiled_with_realized_cat_inputs(*args: Any, **kwargs: Any) -> Any:
    """``torch_build.compile_package`` with inductor's lowering of ``aten.cat`` realizing its
    inputs first (the ``realized-cat-inputs`` variant)."""
    import torch
    from torch._inductor import lowering

    op = torch.ops.aten.cat.default
    original = lowering.lowerings[op]

    def cat(inputs: Any, dim: int = 0) -> Any:
        for tensor in inputs:
            tensor.realize()
        return original(inputs, dim)

    lowering.lowerings[op] = cat
    try:
        return UNVARIED["compile_package"](*args, **kwargs)
    finally:
        lowering.lowerings[op] = original


UNVARIED: dict[str, Any] = {}  # the functions a variant replaced, as they were (``varied``)


def variant_name(text: str) -> str:
    if not text or any(step not in VARIANTS for step in text.split("+")):
        raise argparse.ArgumentTypeError(f"{text!r}: variants are {', '.join(VARIANTS)}, or several joined by '+'")
    return text


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, marks in KINDS if any(mark in low for mark in marks)), "other")


@contextlib.contextmanager
def varied(variant: str) -> Iterator[None]:
    """The default build with ``variant``'s steps changed (the module docstring), inside the block."""
    from app.builder import inductor_settings, torch_build

    steps = [VARIANTS[step] for step in variant.split("+")]
    saved_functions = {name: getattr(torch_build, name) for functions, _ in steps for name in functions}
    saved_settings = inductor_settings.INVARIANT_INDUCTOR_CONFIGS
    UNVARIED.update(saved_functions)
    for functions, settings in steps:
        for name, function in functions.items():
            setattr(torch_build, name, function)
        inductor_settings.INVARIANT_INDUCTOR_CONFIGS = {**inductor_settings.INVARIANT_INDUCTOR_CONFIGS, **settings}
    try:
        yield
    finally:
        for name, function in saved_functions.items():
            setattr(torch_build, name, function)
        inductor_settings.INVARIANT_INDUCTOR_CONFIGS = saved_settings


def build_variant(variant: str, folder: Path, seed: Path | None, say: Any) -> Path:
    """The default engine with ``variant``'s steps changed, built in this process into ``folder``
    with a tuning cache of its own (a copy of ``seed`` where given), and checked by the build
    against the eager model, as every build is."""
    from app.builder import torch_build

    folder.mkdir(parents=True, exist_ok=True)
    cache = folder / "tuning.json"
    if seed is not None and seed.is_file():
        shutil.copyfile(seed, cache)
    with varied(variant):
        path, _ = torch_build.build_for_weights("sample", artifacts_dir=folder / "artifacts", tuning_cache=cache,
                                                say=say)
    return path


def graphed(run: Any, x: Any) -> tuple[Any, Any]:
    """``run(x)`` captured in a CUDA graph (after three runs on a side stream); (graph, output)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x)
    return graph, out


def replay_rate(graph: Any, batch: int, replays: int) -> float:
    import torch

    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return batch * replays / (start.elapsed_time(end) / 1000)


def kernels(run: Any, x: Any, iters: int = 10) -> dict[str, Any]:
    """Device time per forward by kernel and kind, by torch's profiler (no graph)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run(x)
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per[event.name][0] += event.time_range.elapsed_us() / iters
            per[event.name][1] += 1
    kinds: dict[str, float] = defaultdict(float)
    for name, (us, _) in per.items():
        kinds[kernel_kind(name)] += us
    ranked = sorted(per.items(), key=lambda item: -item[1][0])
    return {"device_us": round(sum(us for us, _ in per.values()), 1),
            "by_kind_us": {kind: round(us, 1) for kind, us in sorted(kinds.items(), key=lambda item: -item[1])},
            "launches": sum(n for _, n in per.values()) / iters,
            "kernels": [[name[:120], round(us, 1), n // iters] for name, (us, n) in ranked[:80]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64", help="batch sizes, comma-separated (default: 1,16,64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each runner in turn (default: 3)")
    parser.add_argument("--replays", type=int, default=1920, help="images per timed run of replays (default: 1920)")
    parser.add_argument("--cudnn", action="store_true", help="also the cuDNN package (built if absent, ~100 s)")
    parser.add_argument("--variant", type=variant_name, action="append", default=[],
                        help=f"also a variant of the default engine, built in this process (see the docstring): "
                             f"{', '.join(VARIANTS)}, or several joined by '+'")
    parser.add_argument("--seed", action="append", default=[], metavar="NAME=FILE",
                        help="a tuning cache to copy as variant NAME's before its build")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kernel-ab"), help="the variants' folders")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    from app.builder.torch_build import build_for_weights
    from app.gpu.torch_model import load_package

    if not torch.cuda.is_available():
        raise SystemExit("bench/kernel_ab.py needs a CUDA GPU")
    batches = sorted({int(b) for b in args.batches.split(",")})
    dev = torch.device("cuda", 0)
    say = lambda text: print(text, flush=True)
    builds: dict[str, Any] = {"default": lambda: build_for_weights("sample", say=say)[0]}
    if args.cudnn:
        builds["cudnn"] = lambda: build_for_weights("sample", batch_invariant=False, say=say)[0]
    seeds = dict(item.split("=", 1) for item in args.seed)
    for variant in args.variant:
        seed = Path(seeds[variant]) if variant in seeds else None
        builds[variant] = lambda variant=variant, seed=seed: build_variant(variant, args.work / variant, seed, say)
    packages: dict[str, Path] = {}
    built: dict[str, float] = {}
    for name, build in builds.items():  # each found, or built now, and timed
        t0 = time.perf_counter()
        packages[name] = build()
        built[f"{name}_s"] = round(time.perf_counter() - t0, 1)
    runners = {name: load_package(path, dev) for name, path in packages.items()}
    torch.backends.cudnn.benchmark = True  # the cuDNN package's convolutions as cuDNN would pick them
    images = torch.rand(max(batches), 3, 640, 640, generator=torch.Generator().manual_seed(0)).to(dev).half()
    inputs = {b: images[:b].clone() for b in batches}
    rates: dict[str, list[float]] = defaultdict(list)
    report: dict[str, Any] = {"what": "bench/kernel_ab.py (issue 45, goal 3)", "machine": machine_info(gpu=True),
                              "versions": versions(), "commit": code_revision(), "batches": batches,
                              "packages": {name: str(path) for name, path in packages.items()}, "built_s": built}
    with torch.inference_mode():
        graphs = {(name, b): graphed(run, inputs[b]) for name, run in runners.items() for b in batches}
        names = list(runners)
        for round_index in range(args.rounds):
            # The order turns each round: in a fixed order the variants, replayed after the default,
            # ran 2.1-3.9 % below their profiler sums and the default 0-0.6 % (H100,
            # 2026-12-07-nvidia-h100-pools-fusion-kernel-ab.json); turning it takes the order out.
            order = names[round_index % len(names):] + names[: round_index % len(names)]
            for b in batches:
                for name in order:
                    rates[f"{name}@{b}"].append(round(replay_rate(graphs[name, b][0], b, max(1, args.replays // b)), 1))
            say(f"round {round_index + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()))
        largest = max(batches)
        reference = graphs["default", largest][1].float()
        agreement = {}
        for name in runners:
            head = graphs[name, largest][1]
            diff = (head.float() - reference).abs()
            agreement[name] = {
                "vs_default_max_abs": {"boxes_px": diff[:, :4].max().item(), "scores": diff[:, 4:].max().item()},
                "smaller_batches_equal_largest_bits": {b: bool(torch.equal(graphs[name, b][1], head[:b]))
                                                       for b in batches if b != largest},
                "sha256_16": hashlib.sha256(head.cpu().numpy().tobytes()).hexdigest()[:16]}
        report["img_per_s"] = dict(rates)
        report["median_img_per_s"] = {k: round(statistics.median(v), 1) for k, v in rates.items()}
        report["agreement"] = agreement
        del graphs
        report["kernels"] = {f"{name}@{b}": kernels(run, inputs[b]) for name, run in runners.items()
                             for b in sorted({min(batches), largest})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name in runners:
        say(f"{name}: " + ", ".join(f"b{b} {report['median_img_per_s'][f'{name}@{b}']:,.0f} img/s" for b in batches)
            + f"; b{largest} {report['kernels'][f'{name}@{largest}']['by_kind_us']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
