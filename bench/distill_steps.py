"""How many distillation steps, at which rate, lower the loss in ``tests/unit/builder/int8/test_distill.py``'s
setting (the sample model at 128 pixels, calibrated on 8 views of Ultralytics' two photos, trained on 20 others):
the ratio of the held-out loss after to before, for the tensorrt- and cpu-placed models. The test asserts < 0.8.

    python bench/distill_steps.py --out bench/results/DATE-MACHINE-distill-steps.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from app.benchmark.machine import result_header


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="15:1e-4,15:5e-5,15:3e-5,20:5e-5,30:1e-4", help="steps:rate, comma-separated")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import onnx
    import ultralytics

    from app.builder.int8.distill import DistillSettings, distill
    from app.imaging.letterbox import to_input
    from tests.int8_models import SAMPLE_IMGSZ, photos, qdq_models, tiny_export

    root = Path(tempfile.mkdtemp(prefix="distill-steps-"))
    fp32_path = tiny_export(root / "artifacts", "sample", SAMPLE_IMGSZ)
    views = photos(Path(ultralytics.__file__).parent / "assets", SAMPLE_IMGSZ, 28)
    models = qdq_models(fp32_path, root, [to_input([v]) for v in views[:8]])
    fp32, train = onnx.load(str(fp32_path)), views[8:]
    rows = []
    for target in ("tensorrt", "cpu"):
        for run in args.runs.split(","):
            steps, rate = int(run.split(":")[0]), float(run.split(":")[1])
            _, r = distill(models[target], fp32, train, DistillSettings(steps=steps, batch=4, crop=SAMPLE_IMGSZ, lr=rate,
                                                                        device="cpu", augment=False, time_limit_s=None))
            rows.append({"target": target, "steps": steps, "lr": rate, "loss_before": round(r.eval_loss_before, 5),
                         "loss_after": round(r.eval_loss_after, 5),
                         "ratio": round(r.eval_loss_after / r.eval_loss_before, 3), "backoffs": r.backoffs,
                         "checks": [[s, round(loss, 4)] for s, loss in r.checks], "seconds": round(r.seconds, 1)})
            print(json.dumps(rows[-1]), flush=True)
    out = {**result_header("bench/distill_steps.py"), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
