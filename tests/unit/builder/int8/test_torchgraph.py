"""The torch run of a Q/DQ model equals ONNX Runtime's run of the same model (the reference), on random
inputs, for both targets' placements and schemes; written back, ORT runs what torch trained."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from app.builder.int8 import graph
from app.builder.int8.distill import float_weights, head_pairs
from app.builder.int8.report import OrtModel
from app.builder.int8.torchgraph import QdqGraph
from tests.int8_models import qdq_models, random_inputs, tiny_export


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    fp32_path = tiny_export(root / "artifacts")
    return onnx.load(str(fp32_path)), qdq_models(fp32_path, root)


def quantized_tensors(model) -> list[str]:
    """Every QuantizeLinear output of an activation (the integers), in graph order."""
    inits = {i.name for i in model.graph.initializer}
    return [n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in inits]


def ort_run(model, names: list[str], x: np.ndarray, *, optimize: bool = False) -> list[np.ndarray]:
    """``names`` as ONNX Runtime computes them (unoptimised unless ``optimize``: the Q/DQ nodes as written)."""
    probe = graph.augmented_model(model, names)
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    for out in probe.graph.output:  # a Q or Pad output is an integer tensor
        out.type.tensor_type.elem_type = types.get(out.name, out.type.tensor_type.elem_type)
    return OrtModel(probe.SerializeToString(), optimize=optimize).run(x)


def torch_run(g: QdqGraph, x: np.ndarray) -> list[np.ndarray]:
    with torch.no_grad():
        return [v.numpy() for v in g(torch.from_numpy(x))]


@pytest.mark.parametrize("target", ["cpu", "tensorrt"])
def test_every_node_computes_what_onnx_runtime_computes(tiny, target):
    """Each node run in torch on ONNX Runtime's own values of its inputs gives ORT's output: the
    quantized tensors the same integers, the float ones the same values to float rounding."""
    fp32, models = tiny
    model = models[target]
    heads = [name for pair in head_pairs(fp32) for name in pair]
    g = QdqGraph(model, heads)
    names = [o for n in g.nodes for o in n.output]
    x = random_inputs(7, 1, batch=2)[0]
    values = dict(zip(names, ort_run(model, names, x)), images=x)
    counts: dict[str, int] = {}

    def get(name):
        if name in values:
            return torch.from_numpy(values[name].astype(np.float32))
        return g.const(name)

    for node in g.nodes:
        with torch.no_grad():
            out = g.run_node(node, get)
        for name, got in zip(node.output, out if isinstance(out, list) else [out]):
            want, got = values[name], got.numpy()
            if want.dtype.kind in "iu":  # integers: a tie may round the other way after a 1-ulp Sigmoid
                steps = np.abs(want.astype(np.int64) - got.astype(np.int64))
                assert steps.max() <= 1 and (steps > 0).mean() < 1e-3, name
            else:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()), err_msg=name)
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    assert counts["QuantizeLinear"] > 60 and counts["DequantizeLinear"] > 60 and counts["Conv"] == 63
    if target == "tensorrt":  # the shift's int8 Pad of the Q output and its Sub
        assert counts["Pad"] > 10 and counts["Sub"] > 20


@pytest.mark.parametrize("target", ["cpu", "tensorrt"])
def test_the_whole_model_gives_onnx_runtimes_head(tiny, target):
    """The whole run: a value on a rounding tie (a 1-ulp Sigmoid) may step the other way and move
    what follows a little; the head outputs stay within a few percent of their range."""
    fp32, models = tiny
    heads = [name for pair in head_pairs(fp32) for name in pair]
    g = QdqGraph(models[target], heads)
    for x in random_inputs(7, 2, batch=2):
        for name, w, t in zip(heads, ort_run(models[target], heads, x), torch_run(g, x)):
            assert np.abs(w - t).max() <= 0.05 * np.abs(w).max(), name


def test_a_float_model_runs_as_onnx_runtime_runs_it(tiny):
    fp32, _ = tiny
    heads = [name for pair in head_pairs(fp32) for name in pair]
    x = random_inputs(3, 1, batch=2)[0]
    for w, t in zip(ort_run(fp32, heads, x), torch_run(QdqGraph(fp32, heads), x)):
        np.testing.assert_allclose(t, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", ["cpu", "tensorrt"])
def test_learned_weights_written_back_run_in_onnx_runtime_as_in_torch(tiny, target):
    fp32, models = tiny
    heads = [name for pair in head_pairs(fp32) for name in pair]
    tail = set(graph.head_tail_nodes(fp32))
    convs = [n.name for n in models[target].graph.node if n.op_type == "Conv" and n.name not in tail]
    g = QdqGraph(models[target], heads, trainable=convs, init_weights=float_weights(fp32))
    assert len(g.parameters()) >= 2 * 57  # every body and head Conv: weight and bias
    if target == "cpu":  # s8 weights and int32 biases behind their DQs: float latents
        assert len(g.latent) >= 2 * 57
    # The TensorRT model's Convs reading shifted activations carry the shift's bias term, which
    # follows the learned weights (the ORT run of the written file below includes it).
    assert (len(g.shifted) > 10) if target == "tensorrt" else not g.shifted
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a training step's worth of change, some weights across rounding boundaries
        for p in g.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * p.abs().mean() * 0.05)
    g.clip_weights()
    written = g.write_back()
    x = random_inputs(11, 1, batch=2)[0]
    before = ort_run(models[target], heads, x)
    for name, w, t, old in zip(heads, ort_run(written, heads, x), torch_run(g, x), before):
        assert np.abs(w - t).max() <= 0.02 * np.abs(w).max(), name
        assert np.abs(w - old).max() > 0.05 * np.abs(old).max(), name  # the change did reach the file
    # The file keeps its kind: the CPU model's integer weights stay integers, the TensorRT model's float.
    kinds = {i.name: i.data_type for i in models[target].graph.initializer}
    assert all(i.data_type == kinds[i.name] for i in written.graph.initializer)


def test_the_cpu_model_fused_by_onnx_runtime_still_matches(tiny):
    """ORT's full optimisation fuses the CPU model into QLinearConv (integer sums, one requantize):
    the head agrees with the torch run to within a few output steps."""
    fp32, models = tiny
    heads = [name for pair in head_pairs(fp32) for name in pair]
    x = random_inputs(5, 1, batch=2)[0]
    for name, w, t in zip(heads, ort_run(models["cpu"], heads, x, optimize=True),
                          torch_run(QdqGraph(models["cpu"], heads), x)):
        assert np.abs(w - t).max() <= 0.05 * np.abs(w).max(), name
