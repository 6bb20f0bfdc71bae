"""What F1 ``tests/gpu/test_nvdec.py`` can ask of NVDEC's frames against OpenCV's decode, on the CPU.

NVDEC and FFmpeg decode H.264 to the same YUV (decoding is exact); what differs is the colour
conversion: the GPU path converts NV12 as ``cv2.cvtColor(..., COLOR_YUV2BGR_NV12)`` does (the
NV12 kernel is bit-equal to it, test_nvdec_frames_through_the_kernel), OpenCV's VideoCapture
through swscale. So FFmpeg's YUV as NV12 through ``cvtColor`` stands for NVDEC's frames here,
and both decodes go through the sample model on ONNX Runtime (fp32), with the tests' frame
selections, conf and IoU:

    python bench/nvdec_f1_reference.py .vid/dance-48f.mp4 --out bench/results/....json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.boxes import f1, match_pairs
from app.contracts import DetectParams
from app.runtime import OpenOptions, ensure_artifacts, open_model_dir
from tests.videos import decoded_frames


def nv12_frames(clip: Path, width: int, height: int) -> list[np.ndarray]:
    """FFmpeg's decoded YUV 4:2:0 laid out as NV12 and converted by ``cvtColor``."""
    raw = subprocess.run(["ffmpeg", "-v", "error", "-i", str(clip), "-f", "rawvideo", "-pix_fmt", "yuv420p", "-"],
                         capture_output=True, check=True).stdout
    w, h = width, height
    out = []
    for f in np.frombuffer(raw, np.uint8).reshape(-1, w * h * 3 // 2):
        y = f[: w * h].reshape(h, w)
        u = f[w * h : w * h * 5 // 4].reshape(h // 2, w // 2)
        v = f[w * h * 5 // 4 :].reshape(h // 2, w // 2)
        nv12 = np.concatenate([y, np.stack([u, v], -1).reshape(h // 2, w)], 0)
        out.append(np.ascontiguousarray(cv2.cvtColor(nv12, cv2.COLOR_YUV2BGR_NV12)))
    return out


def compare(ref, got, frames: list[int]) -> dict:
    tp = n_ref = n_got = 0
    unmatched: list[float] = []
    dscore: list[float] = []
    for i in frames:
        a, b = ref[i], got[i]
        pairs = match_pairs(a.boxes, a.class_ids, b.boxes, b.class_ids, iou_thr=0.5)
        tp, n_ref, n_got = tp + len(pairs), n_ref + len(a), n_got + len(b)
        done_a, done_b = {p[0] for p in pairs}, {p[1] for p in pairs}
        unmatched += [float(a.scores[k]) for k in range(len(a)) if k not in done_a]
        unmatched += [float(b.scores[k]) for k in range(len(b)) if k not in done_b]
        dscore += [abs(float(a.scores[p[0]]) - float(b.scores[p[1]])) for p in pairs]
    return {"frames": len(frames), "f1": round(f1(tp, n_ref, n_got), 4), "tp": tp, "n_opencv": n_ref,
            "n_nv12": n_got, "unmatched_scores": sorted(round(s, 3) for s in unmatched),
            "max_abs_dscore_matched": round(max(dscore, default=0.0), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("clip", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    opencv = decoded_frames(args.clip)
    h, w = opencv[0].shape[:2]
    nv12 = nv12_frames(args.clip, w, h)
    diff = [np.abs(a.astype(np.int16) - b.astype(np.int16)) for a, b in zip(opencv, nv12)]
    options = OpenOptions("sample", backend="onnxruntime", precision="fp32")
    detector = open_model_dir(ensure_artifacts(options), options)
    params = DetectParams(conf=0.25, iou=0.7)  # the GPU tests' CONF, IOU
    ref = [r.detections for r in detector.detect(opencv, params)]
    got = [r.detections for r in detector.detect(nv12, params)]
    total = len(opencv)
    pipeline_test = list(range(min(total, 48) - 3))  # test_nvdec_frames_through_the_pipeline_...
    video_streams_test = list(range(0, total, 4)) + 2 * list(range(0, total, 8))  # test_predict_video_and_streams_...
    report = {
        "clip": args.clip.name, "frames": total, "size": [w, h], "nvdec_frames_stand_in": len(nv12),
        "pixel_levels_apart": {"mean": round(float(np.mean([d.mean() for d in diff])), 3),
                               "p99": round(float(np.mean([np.percentile(d, 99) for d in diff])), 2)},
        "pipeline_test": compare(ref, got, pipeline_test),
        "video_and_streams_test": compare(ref, got, video_streams_test),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
