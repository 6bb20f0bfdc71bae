"""The NMS alone on real head outputs (the sample model on the images), batch 1 and 16, conf
0.25 and 0.001: the NumPy reference, Ultralytics' (torchvision), and the Numba CUDA kernels."""

from __future__ import annotations

import statistics
import time

from app.benchmark.baseline import ultralytics_nms_row
from app.benchmark.rows import decoded_frames
from app.benchmark.timing import Budget, batch_of, row

NMS_BATCHES = (1, 16)
NMS_CONFS = (0.25, 0.001)


def nms_rows(model_dir, meta, images, gpu: bool, budget: Budget, iters: int, warmup: int) -> list[dict]:
    from app.backends.onnxruntime import OnnxRuntimeBackend
    from app.boxes import nms_numpy
    from app.contracts import DetectParams
    from app.imaging.letterbox import letterbox, to_input

    batch = to_input([letterbox(f, meta.imgsz)[0] for f in batch_of(decoded_frames(images), max(NMS_BATCHES))])
    ort = OnnxRuntimeBackend(model_dir / "model.onnx")
    head = ort.infer(batch)  # [16, 4 + nc, A] float32
    ort.close()
    rows = []
    for b in NMS_BATCHES:
        for conf in NMS_CONFS:
            params = DetectParams(conf=conf, iou=0.7)
            n_cand = int((head[:b, 4:].max(1) > conf).sum())
            times = budget.measure(lambda b=b, params=params: [nms_numpy(h, params) for h in head[:b]], iters, warmup)
            rows.append(row("yolopipe", "numpy", "fp32", "nms", b, times, conf=conf, candidates=n_cand))
            rows.append(ultralytics_nms_row(head[:b], conf, gpu, budget, iters, warmup, n_cand))
            if gpu:
                rows.append(_gpu_nms_row(head[:b], meta, conf, iters, warmup, n_cand))
    return rows


def _gpu_nms_row(head, meta, conf: float, iters: int, warmup: int, n_cand: int) -> dict:
    """GpuNms on a device head: GPU time of one graph replay (CUDA events), plus eager launches."""
    import torch
    from numba import cuda

    from app.gpu.nms import GpuNms

    b = head.shape[0]
    dev_head = torch.from_numpy(head).cuda()
    stream = torch.cuda.Stream()
    nb_stream = cuda.external_stream(stream.cuda_stream)
    nms = GpuNms(b, meta.num_classes, meta.num_anchors)
    nms.set_params(conf=conf, iou=0.7, stream=nb_stream)
    with torch.cuda.stream(stream):
        for _ in range(2):
            nms.run(dev_head, b, nb_stream)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            nms.run(dev_head, b, nb_stream)
        gpu_ms, eager_ms = [], []
        for i in range(warmup + iters):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            graph.replay()
            e1.record(stream)
            stream.synchronize()
            t0 = time.perf_counter()
            nms.run(dev_head, b, nb_stream)
            stream.synchronize()
            if i >= warmup:
                gpu_ms.append(e0.elapsed_time(e1))
                eager_ms.append((time.perf_counter() - t0) * 1e3)
    graph.reset()
    nms.free()
    return row("yolopipe", "numba-cuda", "fp32", "nms", b, gpu_ms, conf=conf, candidates=n_cand,
               timing="gpu time of one graph replay (CUDA events)",
               eager_launch_p50_ms=round(statistics.median(eager_ms), 4))
