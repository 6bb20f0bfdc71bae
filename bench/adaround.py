"""AdaRound for the CPU INT8 model's s8 per-channel Conv weights (Nagel et al., "Up or Down?
Adaptive Rounding for Post-Training Quantization", 2020), in torch on the CPU.

Per quantized Conv, with its per-channel scales ``s`` kept: each weight ``w`` becomes
``s * clip(floor(w / s) + h(V), qmin, qmax)``, ``h`` the rectified sigmoid
``clip(sigmoid(V) * (zeta - gamma) + gamma, 0, 1)``, ``V`` learnt with Adam to minimise the Conv's
output error plus the annealed regulariser ``lam * sum(1 - |2h - 1|^beta)`` (beta 20 → 2 after a
warm-up without it) that drives every ``h`` to 0 or 1; the rounding is then ``floor + (h >= 0.5)``,
so a weight only ever moves to one of its two neighbouring grid points. ``V`` starts where ``h``
is the fractional part, i.e. at nearest rounding.

The data (one pass of the quantized model itself, unfused): the float tensor each Conv's Q reads
(``bias._float_source``), cut into random output patches with their receptive field. The Conv
being rounded reads that tensor quantized as the model quantizes it (its Q's scale and zero
point); its target is the FP32 Conv on the same float tensor. So each Conv fixes its own share of
the error, reading what the quantized model's earlier layers give it, and errors the earlier
layers make are not counted again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ZETA, GAMMA = 1.1, -0.1


@dataclass
class ConvSpec:
    name: str
    source: str  # the float tensor the Conv's input Q reads
    x_scale: float
    x_zero: int
    x_qmin: int
    x_qmax: int
    weight_init: str  # the s8 initializer behind the weight's DQ
    w_int: np.ndarray
    w_scale: np.ndarray  # per output channel
    w_fp: np.ndarray
    b_q: np.ndarray  # the bias as the quantized model has it (dequantized)
    b_fp: np.ndarray
    stride: tuple[int, int]
    pads: tuple[int, int, int, int]  # top, left, bottom, right
    group: int
    out_range: tuple[float, float] | None = None  # the u8 range of the Conv output's Q, if any
    silu: bool = False  # the FP32 model's Conv output feeds a SiLU (Sigmoid and Mul)


def _attr(node, name, default):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def conv_specs(qdq_model, fp32_model) -> list[ConvSpec]:
    """The quantized Convs AdaRound can change: s8 weight and input both behind a DQ."""
    from onnx import numpy_helper

    inits = {i.name: numpy_helper.to_array(i) for i in qdq_model.graph.initializer}
    fp_inits = {i.name: numpy_helper.to_array(i) for i in fp32_model.graph.initializer}
    producer = {o: n for n in qdq_model.graph.node for o in n.output}
    twins = {n.name: n for n in fp32_model.graph.node if n.op_type == "Conv"}
    fp_consumers: dict[str, list] = {}
    for n in fp32_model.graph.node:
        for i in n.input:
            fp_consumers.setdefault(i, []).append(n.op_type)
    consumers: dict[str, list] = {}
    for n in qdq_model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    specs = []
    for conv in qdq_model.graph.node:
        if conv.op_type != "Conv" or conv.name not in twins:
            continue
        xdq, wdq = producer.get(conv.input[0]), producer.get(conv.input[1])
        if xdq is None or wdq is None or xdq.op_type != "DequantizeLinear" or wdq.op_type != "DequantizeLinear":
            continue
        q = producer.get(xdq.input[0])
        if q is None or q.op_type != "QuantizeLinear" or wdq.input[0] not in inits:
            continue
        if tuple(_attr(conv, "dilations", [1, 1])) != (1, 1):
            continue
        w_int = inits[wdq.input[0]]
        if w_int.dtype != np.int8:
            continue
        x_zero_arr = inits[q.input[2]] if len(q.input) > 2 and q.input[2] else np.uint8(0)
        info = np.iinfo(x_zero_arr.dtype)
        twin = twins[conv.name]
        b_fp = fp_inits[twin.input[2]] if len(twin.input) > 2 else np.zeros(w_int.shape[0], np.float32)
        if len(conv.input) > 2 and conv.input[2]:
            bdq = producer.get(conv.input[2])
            if bdq is not None and bdq.op_type == "DequantizeLinear":
                b_q = inits[bdq.input[0]].astype(np.float64) * inits[bdq.input[1]].astype(np.float64)
            else:
                b_q = inits[conv.input[2]]
        else:
            b_q = np.zeros(w_int.shape[0])
        pads = list(_attr(conv, "pads", [0, 0, 0, 0]))
        out_range = None
        out_q = [n for n in consumers.get(conv.output[0], []) if n.op_type == "QuantizeLinear"]
        if out_q:
            o_scale = float(inits[out_q[0].input[1]])
            o_zero_arr = inits[out_q[0].input[2]]
            o_info = np.iinfo(o_zero_arr.dtype)
            out_range = ((o_info.min - int(o_zero_arr)) * o_scale, (o_info.max - int(o_zero_arr)) * o_scale)
        specs.append(ConvSpec(
            name=conv.name, source=q.input[0], x_scale=float(inits[q.input[1]]), x_zero=int(x_zero_arr),
            x_qmin=int(info.min), x_qmax=int(info.max), weight_init=wdq.input[0], w_int=w_int,
            w_scale=inits[wdq.input[1]].astype(np.float32).reshape(-1), w_fp=fp_inits[twin.input[1]].astype(np.float32),
            b_q=np.asarray(b_q, np.float32).reshape(-1), b_fp=np.asarray(b_fp, np.float32).reshape(-1),
            stride=tuple(_attr(conv, "strides", [1, 1])), pads=(pads[0], pads[1], pads[2], pads[3]),
            group=int(_attr(conv, "group", 1)), out_range=out_range,
            silu="Sigmoid" in fp_consumers.get(twin.output[0], [])))
    return specs


def collect_patches(qdq_model, specs: Sequence[ConvSpec], batches: Sequence[np.ndarray], *, patch: int = 4,
                    per_image: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """Random ``patch`` x ``patch`` output patches' receptive fields of each Conv's float source,
    ``per_image`` per image, from one unfused pass of the quantized model per image."""
    import onnx
    from onnx import helper

    from app.builder.int8.report import OrtModel

    rng = np.random.default_rng(seed)
    probe = onnx.ModelProto()
    probe.CopyFrom(qdq_model)
    del probe.graph.output[:]
    sources = sorted({s.source for s in specs})
    for name in sources:
        probe.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    session = OrtModel(probe.SerializeToString(), optimize=False)
    out: dict[str, list[np.ndarray]] = {s.name: [] for s in specs}
    for batch in batches:
        values = dict(zip(sources, session.run(batch, sources)))
        for s in specs:
            x = values[s.source][0]
            t, l, b, r = s.pads
            x = np.pad(x, ((0, 0), (t, b), (l, r)))
            kh, kw = s.w_fp.shape[2:]
            sh, sw = s.stride
            oh, ow = (x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1
            ph, pw = min(patch, oh), min(patch, ow)
            ih, iw = (ph - 1) * sh + kh, (pw - 1) * sw + kw
            for _ in range(per_image):
                oy, ox = rng.integers(0, oh - ph + 1), rng.integers(0, ow - pw + 1)
                out[s.name].append(x[:, oy * sh : oy * sh + ih, ox * sw : ox * sw + iw].copy())
    return {k: np.stack(v) for k, v in out.items()}


def _h(v):
    import torch

    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0, 1)


def adaround_conv(s: ConvSpec, patches: np.ndarray, *, iters: int = 300, batch: int = 16, lr: float = 3e-2,
                  lam: float = 0.01, warmup: float = 0.2, validation: float = 0.2, activation: bool = False,
                  seed: int = 0) -> tuple[np.ndarray, dict]:
    """The learnt s8 weights of one Conv and its errors (mean squared output error per element,
    nearest vs AdaRound) on the ``validation`` share of ``patches`` (the last images' patches, not
    learnt on) and on the rest. ``activation``: the error is taken after what follows the Conv in
    the quantized model, its output Q's clip and SiLU (the paper's asymmetric reconstruction with
    the activation function, its eq. 25); the FP32 target through SiLU alone."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    n_val = int(len(patches) * validation)
    val_src = torch.from_numpy(patches[len(patches) - n_val :])
    src = torch.from_numpy(patches[: len(patches) - n_val])
    quant = lambda x: (torch.clamp(torch.round(x / s.x_scale) + s.x_zero, s.x_qmin, s.x_qmax) - s.x_zero) * s.x_scale
    xq, val_xq = quant(src), quant(val_src)
    w_fp = torch.from_numpy(s.w_fp)
    scale = torch.from_numpy(s.w_scale).view(-1, 1, 1, 1)
    b_fp, b_q = torch.from_numpy(s.b_fp.copy()), torch.from_numpy(s.b_q.copy())
    def after(y, quantized):
        if not activation:
            return y
        if quantized and s.out_range is not None:
            y = y.clamp(*s.out_range)
        return F.silu(y) if s.silu else y

    raw = lambda x, w, b: F.conv2d(x, w, b, stride=s.stride, groups=s.group)
    conv = lambda x, w, b: after(raw(x, w, b), True)
    with torch.no_grad():
        target = after(raw(src, w_fp, b_fp), False)
        val_target = after(raw(val_src, w_fp, b_fp), False)
    qmin, qmax = -127, 127  # ORT's symmetric s8 weights
    qmin = min(qmin, int(s.w_int.min()))
    qmax = max(qmax, int(s.w_int.max()))
    floor = torch.floor(w_fp / scale)
    rest = (w_fp / scale - floor).clamp(0, 1 - 1e-6)
    v = (-torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1)).requires_grad_(True)
    opt = torch.optim.Adam([v], lr=lr)
    n = src.shape[0]

    def error(w_int, x, t):
        with torch.no_grad():
            return float(((conv(x, scale * w_int, b_q) - t) ** 2).mean()) if len(x) else float("nan")

    nearest = torch.from_numpy(s.w_int.astype(np.float32))
    start = int(iters * warmup)
    for it in range(iters):
        idx = torch.randint(0, n, (min(batch, n),), generator=g)
        w = scale * torch.clamp(floor + _h(v), qmin, qmax)
        out = conv(xq[idx], w, b_q)
        loss = (out - target[idx]).pow(2).sum(1).mean()
        if it >= start:
            beta = 20 + (2 - 20) * (it - start) / max(1, iters - start)
            loss = loss + lam * (1 - (2 * _h(v) - 1).abs().pow(beta)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        learnt = torch.clamp(floor + (_h(v) >= 0.5).float(), qmin, qmax)
    result = learnt.numpy().astype(np.int8)
    stats = {"nearest_mse": error(nearest, val_xq, val_target), "adaround_mse": error(learnt, val_xq, val_target),
             "train_nearest_mse": error(nearest, xq, target), "train_adaround_mse": error(learnt, xq, target),
             "changed": int((result != s.w_int).sum()), "weights": int(result.size)}
    return result, stats


def adaround_model(qdq_model, fp32_model, batches: Sequence[np.ndarray], *, log=None, threads: int = 1,
                   groups: int = 1, **kw):
    """A copy of ``qdq_model`` with every eligible Conv's s8 weights AdaRounded; and per-Conv stats.

    ``groups``: the Convs, in graph order, are rounded in that many groups; each group's patches
    are collected from the model with the earlier groups already rounded (1: one pass of the
    nearest-rounded model for all)."""
    import onnx
    import torch
    from onnx import numpy_helper

    torch.set_num_threads(threads)
    collect_kw = {k: kw.pop(k) for k in ("patch", "per_image") if k in kw}
    t0 = time.perf_counter()
    model = onnx.ModelProto()
    model.CopyFrom(qdq_model)
    inits = {i.name: i for i in model.graph.initializer}
    specs = conv_specs(qdq_model, fp32_model)
    chunks = [list(c) for c in np.array_split(np.arange(len(specs)), max(1, min(groups, len(specs))))]
    stats, collect_s = {}, 0.0
    for chunk in chunks:
        t = time.perf_counter()
        patches = collect_patches(model, [specs[k] for k in chunk], batches, **collect_kw)
        collect_s += time.perf_counter() - t
        for k in chunk:
            s = specs[k]
            t = time.perf_counter()
            w, st = adaround_conv(s, patches.pop(s.name), **kw)
            st["s"] = round(time.perf_counter() - t, 2)
            st["kept"] = st["adaround_mse"] < st["nearest_mse"]  # nearest where it did not help on unseen patches
            if st["kept"]:
                inits[s.weight_init].CopyFrom(numpy_helper.from_array(w, s.weight_init))
            stats[s.name] = st
            if log:
                log(f"{k + 1}/{len(specs)} {s.name} {st}")
    return model, {"convs": stats, "groups": len(chunks), "collect_s": round(collect_s, 1),
                   "total_s": round(time.perf_counter() - t0, 1)}
