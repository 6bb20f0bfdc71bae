"""Why nvImageCodec's decode of batch N+1 does not overlap the engine on batch N: probes in one
process on the GPU machine (issue #16). Writes one JSON file; prints a short table last.

Load: a thread keeps the GPU saturated with fp16 matmuls on its own stream (20 per stream
sync), as in the shared README's probe. Under that load the decode loop is timed per call
(the call, the stream sync, the release of the previous batch's images) for several ways of
holding the output:

* ``new``: a fresh Image per image per call, the previous batch's released (what the pipeline did);
* ``keep``: fresh Images, none released inside the loop;
* ``reuse``: ``decode(..., images=previous)``: nvImageCodec resizes and reuses their buffers;
* ``into``: ``decode(..., images=as_images(views of one preallocated torch buffer))``;

plus driver-level ``cuMemAlloc``/``cuMemFree`` timed under the same load, a torch.profiler
table of the CUDA API calls inside ``new`` and ``into`` decodes, pixel equality of ``into``
against ``new`` on the varied JPEGs, and batch-1 host costs (pinned copy of a 640x480 frame).

    python3 bench/decode_overlap_probe.py --images DIR --out probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

RESULT: dict = {}


def log(*a):
    print(*a, flush=True)


def section(name):
    def wrap(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                RESULT[name] = fn(*a, **k)
            except Exception as exc:  # noqa: BLE001 - a probe that fails is a finding too
                import traceback

                RESULT[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
            log(f"[{name}] {time.perf_counter() - t0:.1f} s: {json.dumps(RESULT[name])[:600]}")

        return run

    return wrap


class Busy:
    """fp16 matmuls on their own stream, ``per_sync`` per stream sync, until stopped."""

    def __init__(self, torch, n=8192, per_sync=20):
        self.torch = torch
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            self.a = torch.randn(n, n, device="cuda", dtype=torch.float16)
            self.b = torch.randn(n, n, device="cuda", dtype=torch.float16)
        self.per_sync = per_sync
        self.iters = 0
        self._stop = threading.Event()
        self._t = None

    def __enter__(self):
        self._stop.clear()
        self.iters = 0
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        time.sleep(0.2)
        return self

    def _loop(self):
        torch = self.torch
        with torch.cuda.stream(self.stream):
            while not self._stop.is_set():
                for _ in range(self.per_sync):
                    torch.mm(self.a, self.b)
                self.stream.synchronize()
                self.iters += 1

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def batch_of(items, n):
    return [items[i % len(items)] for i in range(n)]


def make_views(torch, nv, streams, headers_hw, pool):
    """One preallocated buffer; an as_image view (H, W, 3) per image at aligned offsets."""
    views, offset = [], 0
    for h, w in headers_hw:
        n = h * w * 3
        views.append(pool[offset : offset + n].view(h, w, 3))
        offset += -(-n // 256) * 256
    return views


def decoded_hw(data):
    from app.gpu.jpeg import read_jpeg_header

    hd = read_jpeg_header(data)
    h, w = hd.height, hd.width
    if hd.orientation in (5, 6, 7, 8):
        h, w = w, h
    return h, w


def time_loop(torch, nv, dec, datas, params, stream, mode, calls, busy, pool=None):
    """Per call: decode call, stream sync, release of the previous batch (ms)."""
    prev = None
    kept = []
    hw = [decoded_hw(d) for d in datas]
    views = None
    if mode == "into":
        views = nv.as_images(make_views(torch, nv, None, hw, pool), cuda_stream=stream.cuda_stream)
    rec = {"call": [], "sync": [], "free": [], "none": 0}
    t_all = time.perf_counter()
    for _ in range(calls):
        cs = [nv.CodeStream(d) for d in datas]
        t0 = time.perf_counter()
        if mode == "reuse" and prev is not None:
            out = dec.decode(cs, images=prev, params=params, cuda_stream=stream.cuda_stream)
        elif mode == "into":
            out = dec.decode(cs, images=views, params=params, cuda_stream=stream.cuda_stream)
        else:
            out = dec.decode(cs, params=params, cuda_stream=stream.cuda_stream)
        t1 = time.perf_counter()
        stream.synchronize()
        t2 = time.perf_counter()
        rec["none"] += sum(o is None for o in out)
        if mode == "new":
            prev = None  # the previous batch's Images are released here
        t3 = time.perf_counter()
        if mode == "keep":
            kept.append(out)
        elif mode in ("new", "reuse"):
            prev = out
        rec["call"].append((t1 - t0) * 1e3)
        rec["sync"].append((t2 - t1) * 1e3)
        rec["free"].append((t3 - t2) * 1e3)
    wall = time.perf_counter() - t_all
    t0 = time.perf_counter()
    kept = prev = out = None
    free_end = (time.perf_counter() - t0) * 1e3
    return {
        "mode": mode, "busy": busy, "calls": calls, "img_per_s": round(calls * len(datas) / wall, 1),
        "call_ms_p50": round(statistics.median(rec["call"]), 3), "call_ms_max": round(max(rec["call"]), 3),
        "sync_ms_p50": round(statistics.median(rec["sync"]), 3), "free_ms_p50": round(statistics.median(rec["free"]), 3),
        "free_ms_max": round(max(rec["free"]), 3), "free_at_end_ms": round(free_end, 3), "none": rec["none"],
    }


@section("stderr_of_import")
def stderr_of_import():
    """What a bare import + Decoder prints, and with our environment (extensions path, verbosity)."""
    out = {}
    code = ("import os,sys;from nvidia import nvimgcodec as nv;"
            "d=nv.Decoder(device_id=0,max_num_cpu_threads=int(sys.argv[1]));print('ok')")
    import os
    import tempfile

    from nvidia import nvimgcodec

    ext = Path(nvimgcodec.__file__).parent / "extensions"
    limited = tempfile.mkdtemp(prefix="nvimgcodec-ext-")
    for f in ext.iterdir():
        if "nvjpeg2k" not in f.name and "nvtiff" not in f.name:
            os.symlink(f, Path(limited) / f.name)
    cases = {
        "default_16threads": ({}, "16"),
        "default_8threads": ({}, "8"),
        "verbosity0": ({"PYNVIMGCODEC_VERBOSITY": "0"}, "16"),
        "verbosity1": ({"PYNVIMGCODEC_VERBOSITY": "1"}, "16"),
        "ext_limited": ({"NVIMGCODEC_EXTENSIONS_PATH": limited}, "8"),
        "ext_limited_verbosity1": ({"NVIMGCODEC_EXTENSIONS_PATH": limited, "PYNVIMGCODEC_VERBOSITY": "1"}, "8"),
    }
    for name, (env, threads) in cases.items():
        p = subprocess.run([sys.executable, "-c", code, threads], env={**os.environ, **env}, capture_output=True,
                           text=True, timeout=60)
        out[name] = {"rc": p.returncode, "stdout": p.stdout[-300:], "stderr": p.stderr[-1500:]}
    out["extensions"] = sorted(f.name for f in ext.iterdir())
    return out


@section("alloc_under_load")
def alloc_under_load(torch):
    """cuMemAlloc / cuMemFree of 8 MB, alone and while the matmul thread keeps the GPU busy."""
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    cu.cuMemAllocAsync.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_void_p]
    cu.cuMemFreeAsync.argtypes = [ctypes.c_uint64, ctypes.c_void_p]
    s = torch.cuda.Stream()

    def once(kind):
        p = ctypes.c_uint64()
        t0 = time.perf_counter()
        if kind == "sync":
            assert cu.cuMemAlloc_v2(ctypes.byref(p), 8 << 20) == 0
        else:
            assert cu.cuMemAllocAsync(ctypes.byref(p), 8 << 20, ctypes.c_void_p(s.cuda_stream)) == 0
        t1 = time.perf_counter()
        if kind == "sync":
            assert cu.cuMemFree_v2(p) == 0
        else:
            assert cu.cuMemFreeAsync(p, ctypes.c_void_p(s.cuda_stream)) == 0
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    out = {}
    torch.cuda.set_device(0)
    torch.cuda.init()
    for busy in (False, True):
        for kind in ("sync", "async"):
            ctx = Busy(torch) if busy else None
            if ctx:
                ctx.__enter__()
            try:
                vals = [once(kind) for _ in range(10)]
            finally:
                if ctx:
                    ctx.__exit__()
            out[f"{kind}_{'busy' if busy else 'idle'}"] = {
                "alloc_ms_p50": round(statistics.median(v[0] for v in vals), 3),
                "free_ms_p50": round(statistics.median(v[1] for v in vals), 3),
                "free_ms_max": round(max(v[1] for v in vals), 3)}
    return out


@section("decode_under_load")
def decode_under_load(torch, nv, datas, threads):
    params = nv.DecodeParams(apply_exif_orientation=True, color_spec=nv.ColorSpec.SRGB, allow_any_depth=False)
    chain = nv.Decoder(device_id=0, max_num_cpu_threads=threads, options=":fancy_upsampling=1")
    hw = nv.Decoder(device_id=0, backends=[nv.Backend(nv.BackendKind.HW_GPU_ONLY)], options=":fancy_upsampling=1")
    stream = torch.cuda.Stream()
    pool = torch.empty(len(datas) * 1920 * 1080 * 3, dtype=torch.uint8, device="cuda")
    rows = []
    for dec_name, dec in (("hw", hw), ("chain", chain)):
        for mode in ("new", "into"):  # warm
            try:
                time_loop(torch, nv, dec, datas, params, stream, mode, 2, False, pool)
            except Exception as exc:  # noqa: BLE001
                rows.append({"decoder": dec_name, "mode": mode, "warm_error": f"{type(exc).__name__}: {exc}"})
        for busy in (False, True):
            for mode in ("new", "keep", "reuse", "into"):
                if dec_name == "chain" and mode == "keep":
                    continue
                ctx = Busy(torch) if busy else None
                t0 = time.perf_counter()
                if ctx:
                    ctx.__enter__()
                try:
                    r = time_loop(torch, nv, dec, datas, params, stream, mode, 6 if busy else 10, busy, pool)
                except Exception as exc:  # noqa: BLE001
                    rows.append({"decoder": dec_name, "mode": mode, "busy": busy, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                finally:
                    if ctx:
                        ctx.__exit__()
                if ctx:
                    r["busy_matmul_syncs_per_s"] = round(ctx.iters / (time.perf_counter() - t0), 2)
                r["decoder"] = dec_name
                rows.append(r)
                log(f"  {dec_name:5s} {mode:5s} busy={busy}: {r['img_per_s']:8.1f} img/s call {r['call_ms_p50']:.2f} ms "
                    f"sync {r['sync_ms_p50']:.2f} free {r['free_ms_p50']:.2f} (max {r['free_ms_max']:.2f}) none {r['none']}")
    return rows


@section("profile")
def profile(torch, nv, datas, threads):
    """CUDA API calls inside decodes under load: which one waits (torch.profiler, CUPTI)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    params = nv.DecodeParams(apply_exif_orientation=True, color_spec=nv.ColorSpec.SRGB, allow_any_depth=False)
    hw = nv.Decoder(device_id=0, backends=[nv.Backend(nv.BackendKind.HW_GPU_ONLY)], options=":fancy_upsampling=1")
    stream = torch.cuda.Stream()
    pool = torch.empty(len(datas) * 1920 * 1080 * 3, dtype=torch.uint8, device="cuda")
    out = {}
    for mode in ("new", "into"):
        time_loop(torch, nv, hw, datas, params, stream, mode, 2, False, pool)
        with Busy(torch), tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            time_loop(torch, nv, hw, datas, params, stream, mode, 3, True, pool)
        agg: dict[tuple, list[float]] = {}
        for e in prof.events():
            name = e.name
            if name.startswith(("cuda", "cu")) and str(getattr(e.device_type, "name", e.device_type)) == "CPU":
                agg.setdefault((name, int(getattr(e, "thread", 0) or 0)), []).append(e.cpu_time_total / 1e3)
        table = sorted(((k, len(v), round(sum(v), 3), round(max(v), 3)) for k, v in agg.items()), key=lambda t: -t[2])
        out[mode] = [{"api": k[0], "thread": k[1], "count": c, "total_ms": t, "max_ms": m} for k, c, t, m in table[:30]]
        out["main_thread"] = threading.get_native_id()
        if mode == "new":
            prof.export_chrome_trace("/tmp/probe-trace-new.json")
    return out


@section("into_equals_new")
def into_equals_new(torch, nv, threads):
    """Decoding into views of our buffer gives the bytes of nvImageCodec's own Images."""
    from app.benchmark.workloads import varied_jpegs
    from app.gpu.jpeg import read_jpeg_header

    params = nv.DecodeParams(apply_exif_orientation=True, color_spec=nv.ColorSpec.SRGB, allow_any_depth=False)
    chain = nv.Decoder(device_id=0, max_num_cpu_threads=threads, options=":fancy_upsampling=1")
    hw = nv.Decoder(device_id=0, backends=[nv.Backend(nv.BackendKind.HW_GPU_ONLY)], options=":fancy_upsampling=1")
    stream = torch.cuda.Stream()
    varied = [(n, d) for n, d in varied_jpegs() if read_jpeg_header(d) and read_jpeg_header(d).gpu_decodable]
    pool = torch.zeros(sum(h * w * 3 + 256 for h, w in (decoded_hw(d) for _, d in varied)), dtype=torch.uint8,
                       device="cuda")
    out = {"images": len(varied), "by_decoder": {}}
    for name, dec in (("hw", hw), ("chain", chain)):
        cs = [nv.CodeStream(d) for _, d in varied]
        ref = dec.decode(cs, params=params, cuda_stream=stream.cuda_stream)
        pool.fill_(7)
        views = make_views(torch, nv, None, [decoded_hw(d) for _, d in varied], pool)
        imgs = nv.as_images(views, cuda_stream=stream.cuda_stream)
        got = dec.decode([nv.CodeStream(d) for _, d in varied], images=imgs, params=params,
                         cuda_stream=stream.cuda_stream)
        stream.synchronize()
        same, differ, none_ref, none_got, other_ptr = 0, [], 0, 0, 0
        for (n, _), r, g, v in zip(varied, ref, got, views):
            if r is None:
                none_ref += 1
                continue
            if g is None:
                none_got += 1
                continue
            if int(g.__cuda_array_interface__["data"][0]) != v.data_ptr():
                other_ptr += 1
            rt = torch.as_tensor(r, device="cuda")
            if tuple(rt.shape) == tuple(v.shape) and torch.equal(rt, v):
                same += 1
            else:
                differ.append(n)
        out["by_decoder"][name] = {"same": same, "differ": differ[:10], "refused_new": none_ref,
                                   "refused_into": none_got, "decoded_elsewhere": other_ptr}
    return out


@section("batch1_host")
def batch1_host(torch):
    """A 640x480 BGR frame into pinned memory: inline np.copyto, the thread pool; H2D times."""
    from concurrent.futures import ThreadPoolExecutor

    from app.gpu.pack import copy_frames

    frame = np.random.randint(0, 255, (480, 640, 3), np.uint8)
    pinned = torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True)
    host = pinned.numpy()
    dev = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    pool = ThreadPoolExecutor(16)
    out = {}

    def med(fn, n=300):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        return round(statistics.median(ts), 2)

    dst = host[: frame.nbytes].reshape(frame.shape)
    out["copyto_inline_us"] = med(lambda: np.copyto(dst, frame))
    frames = [np.random.randint(0, 255, (480, 640, 3), np.uint8) for _ in range(64)]
    it = iter(range(10**9))
    out["copyto_inline_cold_us"] = med(lambda: np.copyto(dst, frames[next(it) % 64]))
    from app.gpu import pack

    new_min = pack.PARALLEL_PACK_MIN_BYTES
    pack.PARALLEL_PACK_MIN_BYTES = 256 * 1024  # before issue #16: a 640x480 frame went to 3 threads
    out["copy_frames_pool16_old_split_us"] = med(lambda: copy_frames(host, [(0, frame)], pool.map, 16))
    pack.PARALLEL_PACK_MIN_BYTES = new_min
    out["copy_frames_pool16_now_us"] = med(lambda: copy_frames(host, [(0, frame)], pool.map, 16))
    s = torch.cuda.Stream()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(50):
        with torch.cuda.stream(s):
            e0.record(s)
            dev[: frame.nbytes].copy_(pinned[: frame.nbytes], non_blocking=True)
            e1.record(s)
        s.synchronize()
        gpu.append(e0.elapsed_time(e1))
    out["h2d_pinned_gpu_ms_p50"] = round(statistics.median(gpu), 4)
    src = torch.from_numpy(frame.reshape(-1))
    out["h2d_pageable_wall_us"] = med(lambda: (dev[: frame.nbytes].copy_(src, non_blocking=True), s.synchronize()), 100)
    pool.shutdown()
    return out


def connections_worker(images: Path, threads: int) -> None:
    """One process: hw decoder, ``new`` and ``into`` outputs, idle and under load; one JSON line."""
    import os

    import torch

    torch.cuda.init()
    from nvidia import nvimgcodec as nv

    files = sorted(p for p in images.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    datas = batch_of([p.read_bytes() for p in files], 128)
    params = nv.DecodeParams(apply_exif_orientation=True, color_spec=nv.ColorSpec.SRGB, allow_any_depth=False)
    hw = nv.Decoder(device_id=0, backends=[nv.Backend(nv.BackendKind.HW_GPU_ONLY)], options=":fancy_upsampling=1")
    stream = torch.cuda.Stream()
    pool = torch.empty(len(datas) * 1920 * 1080 * 3, dtype=torch.uint8, device="cuda")
    rows = []
    for mode in ("new", "into"):
        time_loop(torch, nv, hw, datas, params, stream, mode, 2, False, pool)
        for busy in (False, True):
            t0 = time.perf_counter()
            ctx = Busy(torch) if busy else None
            if ctx:
                ctx.__enter__()
            try:
                r = time_loop(torch, nv, hw, datas, params, stream, mode, 6, busy, pool)
            finally:
                if ctx:
                    ctx.__exit__()
            if ctx:
                r["busy_matmul_syncs_per_s"] = round(ctx.iters / (time.perf_counter() - t0), 2)
            rows.append(r)
    print("RESULT " + json.dumps({"CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
                                  "rows": rows}), flush=True)


@section("connections")
def connections(images: Path, threads: int):
    """The same decode under load with 8 (CUDA's default) and 32 hardware work queues."""
    import os

    out = []
    for conn in ("8", "32"):
        p = subprocess.run([sys.executable, __file__, "--images", str(images), "--out", "-", "--worker"],
                           env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": conn}, capture_output=True, text=True,
                           timeout=120, check=False)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        out.append(json.loads(line[-1][7:]) if line else {"conn": conn, "rc": p.returncode,
                                                          "stderr": p.stderr[-1500:]})
        for r in out[-1].get("rows", []):
            log(f"  connections={conn} {r['mode']:5s} busy={r['busy']!s:5s} {r['img_per_s']:8.1f} img/s "
                f"call {r['call_ms_p50']:.2f} sync {r['sync_ms_p50']:.2f} matmul syncs/s {r.get('busy_matmul_syncs_per_s')}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--only", default="", help="comma-separated sections (default: all but connections)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        connections_worker(a.images, a.threads)
        return
    if a.only == "connections":
        connections(a.images, a.threads)
        a.out.write_text(json.dumps(RESULT, indent=1))
        return
    import torch

    torch.cuda.init()
    stderr_of_import()
    from nvidia import nvimgcodec as nv

    files = sorted(p for p in a.images.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    datas = batch_of([p.read_bytes() for p in files], 128)
    RESULT["setup"] = {"images": len(files), "batch": len(datas), "gpu": torch.cuda.get_device_name(0),
                       "nvimgcodec": nv.__version__, "torch": torch.__version__}
    alloc_under_load(torch)
    decode_under_load(torch, nv, datas, a.threads)
    into_equals_new(torch, nv, a.threads)
    profile(torch, nv, datas, a.threads)
    batch1_host(torch)
    a.out.write_text(json.dumps(RESULT, indent=1))
    log("\n== decode under load (img/s) ==")
    for r in RESULT.get("decode_under_load", []) if isinstance(RESULT.get("decode_under_load"), list) else []:
        if "img_per_s" not in r:
            log(r)
            continue
        log(f"{r['decoder']:5s} {r['mode']:5s} busy={r['busy']!s:5s} {r['img_per_s']:9.1f}  call {r['call_ms_p50']:7.2f} "
            f"sync {r['sync_ms_p50']:7.2f} free {r['free_ms_p50']:7.2f}/{r['free_ms_max']:7.2f}")
    for mode, table in (RESULT.get("profile") or {}).items():
        if isinstance(table, list):
            log(f"== CUDA API in '{mode}' decodes under load ==")
            for t in table[:10]:
                log(f"  {t['api']:36s} tid {t['thread']:8d} n={t['count']:5d} total {t['total_ms']:9.2f} ms "
                    f"max {t['max_ms']:8.2f} ms")


if __name__ == "__main__":
    main()
