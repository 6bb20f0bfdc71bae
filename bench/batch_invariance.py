"""Where does the batch change an image's answer? (issue #35) One GPU run, stage by stage.

* ``engine``: the engine alone (the AOTInductor package ``yolopipe build-engine`` built, and
  the eager model), one letterboxed photo at several positions among random companions, in
  batches of every size asked for: is its head output bit-identical to the same photo alone,
  and within one size whatever the companions? Also the time per batch size.
* ``pipeline``: the GPU pipeline as the determinism test runs it (bucket 8, three slots): per
  photo, how many distinct letterboxed inputs, head outputs and answers it got; so a difference
  is pinned to decode + letterbox, or to the engine, or to NMS.
* ``decode``: nvImageCodec's hardware decoder and its default chain against OpenCV, alone and
  in a batch: the pixels that differ.

    python bench/batch_invariance.py --images .data/images --out invariance.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import cv2
import numpy as np


def digest(t) -> str:
    return hashlib.sha1(t.contiguous().cpu().numpy().tobytes()).hexdigest()[:12]


def photos(assets: Path, folder: Path | None) -> dict[str, bytes]:
    bus, zidane = cv2.imread(str(assets / "bus.jpg")), cv2.imread(str(assets / "zidane.jpg"))

    def jpg(img, *flags):
        return cv2.imencode(".jpg", img, list(flags))[1].tobytes()

    out = {"bus": (assets / "bus.jpg").read_bytes(), "zidane": (assets / "zidane.jpg").read_bytes(),
           "bus_flipped": jpg(bus[:, ::-1]), "zidane_small": jpg(cv2.resize(zidane, (640, 360))),
           "bus_gray": jpg(cv2.cvtColor(bus, cv2.COLOR_BGR2GRAY)),
           "zidane_huge": jpg(cv2.resize(zidane, (3840, 2160))),
           "bus_restarts": jpg(bus, cv2.IMWRITE_JPEG_RST_INTERVAL, 8),
           "bus_progressive": jpg(bus, cv2.IMWRITE_JPEG_PROGRESSIVE, 1)}
    for p in sorted(folder.glob("*.jpg"))[:8] if folder else []:
        out[p.stem] = p.read_bytes()
    return out


def letterboxed(data: bytes, size: int):
    from app.imaging.letterbox import letterbox, to_input

    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    return to_input([letterbox(img, size)[0]])[0]


def engine_rows(engine, inputs: list, sizes: list[int], trials: int, torch) -> dict:
    """Per batch size: per probe, whether its head equals the probe alone (bitwise), the largest
    difference, and whether every trial of that size gave the same head."""
    rng = np.random.default_rng(0)
    dtype = torch.float16 if engine.precision == "fp16" else torch.float32
    pool = torch.stack([torch.from_numpy(x) for x in inputs]).to("cuda", dtype)
    probes = list(range(min(4, len(inputs))))
    alone = {}
    out: dict = {"sizes": {}}
    for n in sizes:
        if n > engine.max_batch:
            continue
        row = {"equal_to_alone": [], "max_abs_diff": 0.0, "same_within_size": True, "heads": []}
        for p in probes:
            seen = set()
            for t in range(trials if n > 1 else 1):
                idx = rng.integers(0, len(inputs), n)
                pos = [0, n - 1, n // 2][t % 3]
                idx[pos] = p
                with torch.inference_mode():
                    head = engine.forward(pool[torch.as_tensor(idx, device="cuda")].contiguous())
                torch.cuda.synchronize()
                h = head[pos].float()
                if n == 1:
                    alone[p] = h.clone()
                seen.add(digest(head[pos]))
                d = float((h - alone[p]).abs().max())
                row["max_abs_diff"] = max(row["max_abs_diff"], d)
                row["equal_to_alone"].append(d == 0.0)
            row["same_within_size"] &= len(seen) == 1
            row["heads"].append(sorted(seen))
        # time per batch of n (eager launch, synchronised)
        x = pool[torch.as_tensor(rng.integers(0, len(inputs), n), device="cuda")].contiguous()
        with torch.inference_mode():
            for _ in range(3):
                engine.forward(x)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                engine.forward(x)
            torch.cuda.synchronize()
        row["ms_per_batch"] = (time.perf_counter() - t0) / 10 * 1e3
        row["img_per_s"] = n / row["ms_per_batch"] * 1e3
        row["equal_to_alone"] = all(row["equal_to_alone"])
        out["sizes"][n] = row
        print(f"  {engine.compiler:8s} n={n:3d} alone-equal={row['equal_to_alone']!s:5s} "
              f"within={row['same_within_size']!s:5s} maxdiff={row['max_abs_diff']:.5f} "
              f"{row['img_per_s']:.0f} img/s", flush=True)
    # which sizes give the same head as which (per probe 0: the heads' digests)
    groups: dict[str, list[int]] = {}
    for n, row in out["sizes"].items():
        groups.setdefault("|".join(h[0] for h in row["heads"]), []).append(n)
    out["groups"] = list(groups.values())
    print(f"  {engine.compiler}: sizes giving the same heads: {out['groups']}", flush=True)
    return out


def pipeline_rows(pipe, data: dict[str, bytes], trials: int) -> dict:
    """The determinism test's batches, one thread: per photo the distinct inputs, heads, answers."""
    from app.contracts import DetectParams, EncodedImage
    from app.gpu.capture import graph_key
    from app.imaging.headers import read_header

    params = DetectParams(conf=0.25, iou=0.7)
    rng = np.random.default_rng(0)
    others = [n for n in data if n != "bus"]
    seen: dict[str, dict[str, set]] = {}
    per_slot: dict[str, dict[int, set]] = {}
    for k in range(trials):
        batch = [str(x) for x in rng.choice(others, 7)]
        batch.insert(k % 8, "bus")
        run = pipe.run([EncodedImage(data[n], read_header(data[n])) for n in batch], params)
        slot, bucket = run.facts.slot, run.facts.bucket
        head = pipe.slots[slot].graphs.get(graph_key(bucket)).head
        for j, n in enumerate(batch):
            rows = run.images[j][0]
            s = seen.setdefault(n, {"input": set(), "head": set(), "rows": set()})
            s["input"].add(digest(pipe.inputs.tensor[j]))
            s["head"].add(digest(head[j]))
            s["rows"].add(hashlib.sha1(rows.tobytes()).hexdigest()[:12])
            per_slot.setdefault(n, {}).setdefault(slot, set()).add(digest(head[j]))
    out = {n: {k: len(v) for k, v in s.items()} for n, s in seen.items()}
    out["_heads_per_slot"] = {n: {s: len(v) for s, v in d.items()} for n, d in per_slot.items()}
    for n, s in out.items():
        print(f"  {n}: {s}", flush=True)
    return out


def decode_rows(data: dict[str, bytes]) -> dict:
    import torch

    from app.gpu.nvimgcodec import NvImageCodecDecoder

    dec = NvImageCodecDecoder(0)
    nv = dec._nv
    out = {}
    for name, blob in data.items():
        ref = cv2.cvtColor(cv2.imdecode(np.frombuffer(blob, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        row = {}
        for label, decoder in (("hw", dec._hw), ("chain", dec._chain)):
            if decoder is None:
                continue
            got = []
            for batch in ([blob], [blob] + [data["zidane"]] * 5, [data["bus_progressive"]] * 3 + [blob]):
                try:
                    imgs = decoder.decode([nv.CodeStream(b) for b in batch], params=dec._params,
                                          cuda_stream=dec.stream.cuda_stream)
                except Exception as exc:  # noqa: BLE001
                    got.append(f"raised {type(exc).__name__}")
                    continue
                img = imgs[0] if batch[0] is blob else imgs[-1]
                if img is None:
                    got.append("refused")
                    continue
                dec.stream.synchronize()
                a = torch.as_tensor(img, device="cuda").cpu().numpy()
                got.append(hashlib.sha1(a.tobytes()).hexdigest()[:12] + f" differs-from-opencv="
                           f"{int((a.astype(int) != ref).sum())}/{a.size} max={int(np.abs(a.astype(int) - ref).max())}")
            row[label] = got
        out[name] = row
        print(f"  {name}: {row}", flush=True)
    dec.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="decode,engine,pipeline")
    ap.add_argument("--sizes", default="1,2,3,4,5,8,16,32,33,64")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--cudnn", action="store_true", help="also the package with cuDNN's kernels (built if missing)")
    ap.add_argument("--no-eager", dest="eager", action="store_false", help="not the eager model")
    args = ap.parse_args(argv)

    import torch
    import ultralytics

    from app.backends.torch_cuda import TorchCudaEngine
    from app.benchmark.machine import result_header
    from app.contracts import RunShape
    from app.runtime import export_model, open_model_dir
    from app.types import ModelMeta

    assets = Path(ultralytics.__file__).parent / "assets"
    data = photos(assets, args.images)
    model_dir = export_model("sample")
    meta = ModelMeta.load(model_dir / "meta.json")
    result: dict = {**result_header("bench/batch_invariance.py", gpu=True), "code": os.environ.get("YOLOPIPE_CODE"),
                    "cudnn": torch.backends.cudnn.version()}
    parts = args.parts.split(",")
    if "decode" in parts:
        print("decode", flush=True)
        result["decode"] = decode_rows(data)
    sizes = [int(s) for s in args.sizes.split(",")]
    if "engine" in parts:
        inputs = [letterboxed(d, meta.imgsz) for d in data.values()]
        result["engine"] = {}
        for invariant in (True, False) if args.cudnn else (True,):
            det = open_model_dir(model_dir, RunShape(max_batch=max(sizes), in_flight=1), compile=True,
                                 batch_invariant=invariant)
            engine = det.pipeline.engine  # looks inside: the engine alone, as pipeline_rows looks at slots
            name = f"{engine.compiler}-{'invariant' if engine.batch_invariant else 'cudnn'}"
            print(f"engine {name}", flush=True)
            result["engine"][name] = engine_rows(engine, inputs, sizes, args.trials, torch)
            det.close()
        if args.eager:
            eager = TorchCudaEngine(model_dir, meta, precision="fp16", max_batch=max(sizes), compile=False)
            print("engine eager", flush=True)
            result["engine"]["eager"] = engine_rows(eager, inputs, sizes, args.trials, torch)
            torch.backends.cudnn.enabled = False  # ATen's own convolution: per image, so batch-invariant?
            print("engine eager without cuDNN", flush=True)
            result["engine"]["eager-no-cudnn"] = engine_rows(eager, inputs, [1, 2, 8], args.trials, torch)
            torch.backends.cudnn.enabled = True
            eager.close()
    if "pipeline" in parts:
        result["pipeline"] = {}
        for compile_ in (True, False) if args.eager else (True,):
            det = open_model_dir(model_dir, RunShape(max_batch=8, in_flight=3), compile=compile_)
            name = det.diagnose().compiler
            print(f"pipeline {name}", flush=True)
            result["pipeline"][name] = pipeline_rows(det.pipeline, data, 24)  # looks inside: slots, graph heads
            det.close()
    args.out.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
