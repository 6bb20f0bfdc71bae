"""What each choice of the CPU model's Q/DQ is worth (issue #20), on one calibration's ranges.

Reads an artifacts folder that ``yolopipe calibrate`` wrote (its histogram cache and report),
writes CPU-model variants from the same histograms and scores each against FP32 on a held-out
folder (F1 with its bootstrap interval), with their latency interleaved in one loop:

* ``all ops, |x| ranges``: the previous CPU model (every op ORT quantizes, Sigmoid/Mul/Split too);
* ``fused ops, |x| ranges``: Conv/Add/Concat/MaxPool/Resize only, ranges unfitted;
* ``fused ops + Sigmoid/Mul, SiLU-fitted``: SiLU quantized too (QLinearSigmoid, QLinearMul);
* ``fused ops, SiLU-fitted``: what ``calibrate`` writes before mixed precision;
* ``Conv inputs only (u8)``: the TensorRT placement in u8: nothing fused, the accuracy bound;
* the installed ``model.int8-cpu.onnx`` (after mixed precision).

    python bench/int8_placement.py --model-dir <artifacts>/sample-…/imgsz640 --heldout <folder>
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.benchmark.machine import machine_info, versions
from app.builder.int8 import graph
from app.builder.int8.calibration import load_heldout
from app.builder.int8.histograms import load_histograms
from app.builder.int8.images import list_items
from app.builder.int8.report import detect, summarize
from app.builder.int8.thresholds import compute_ranges, silu_preactivation_ranges, to_tensors_data
from bench.int8_cpu_latency import interleaved_latency
from bench.int8_libraries import figures


def write(fp32: Path, out: Path, ranges: dict, ops, floats, *, outputs: bool = True) -> Path:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.calibrate import save_tensors_data

    cache = out.with_suffix(".json")
    save_tensors_data(to_tensors_data(ranges, "percentile"), cache)
    extra = {"ActivationSymmetric": False, "WeightSymmetric": True}
    if not outputs:
        extra["OpTypesToExcludeOutputQuantization"] = list(ops)
    quantize_static(str(fp32), str(out), calibration_data_reader=None, quant_format=QuantFormat.QDQ, per_channel=True,
                    reduce_range=False, weight_type=QuantType.QInt8, activation_type=QuantType.QUInt8,
                    nodes_to_exclude=list(floats), op_types_to_quantize=list(ops) if ops else None,
                    calibrate_method=CalibrationMethod.Percentile, calibration_cache_path=str(cache),
                    extra_options=extra)
    return out


def main() -> None:
    import onnx

    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--heldout", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    own = json.loads((args.model_dir / "int8_report.json").read_text())
    fp32 = args.model_dir / "model.onnx"
    model = onnx.load(str(fp32))
    floats = graph.float_nodes(model)
    raw = compute_ranges(load_histograms(Path(own["cache"])), own["method"], full_range=["images"])
    fitted = silu_preactivation_ranges(raw, graph.silu_pairs(model))
    five = graph.CPU_OP_TYPES
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        variants = {
            "all ops, |x| ranges (previous CPU model)": write(fp32, t / "a.onnx", raw, None, floats),
            "fused ops, |x| ranges": write(fp32, t / "b.onnx", raw, five, floats),
            "fused ops + Sigmoid/Mul, SiLU-fitted": write(fp32, t / "c.onnx", fitted, (*five, "Sigmoid", "Mul"), floats),
            "fused ops, SiLU-fitted (calibrate, before mixed precision)": write(fp32, t / "d.onnx", fitted, five, floats),
            "Conv inputs only, u8 (unfused)": write(fp32, t / "e.onnx", raw, five, floats, outputs=False),
            "installed model.int8-cpu.onnx": args.model_dir / "model.int8-cpu.onnx",
        }
        heldout = load_heldout(list_items(args.heldout), 640, args.heldout, None)
        reference = detect(fp32, heldout)
        rows = []
        for name, path in variants.items():
            rows.append({"variant": name, **figures(summarize(name, heldout.names, reference, detect(path, heldout)))})
            print(rows[-1], flush=True)
        load = os.getloadavg()
        latency = interleaved_latency({"fp32": fp32, **variants}, rounds=args.rounds)
    for row in rows:
        row["latency_over_fp32"] = round(latency[row["variant"]]["median_ms"] / latency["fp32"]["median_ms"], 3)
    result = {
        "bench": "int8-cpu-placement",
        "issue": 20,
        "date": dt.date.today().isoformat(),
        "machine": {**machine_info(), "load_average_before_latency": [round(v, 2) for v in load],
                    "note": "2 shared CPU cores; latency interleaved in one loop"},
        "versions": versions(("onnxruntime", "onnx", "numpy")),
        "calibration": {"ranges_from": own["cache"], "method": own["method"],
                        "calibration_images": own["calibration_images"]},
        "heldout": f"{len(heldout)} images of another distribution (bench/int8_heldout.py)",
        "installed_mixed_precision": own["mixed_precision"].get("cpu", {}).get("layers", []),
        "rows": rows,
        "latency": latency,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{result['date']}-int8-cpu-placement.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
