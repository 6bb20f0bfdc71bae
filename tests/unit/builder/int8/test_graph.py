"""What stays float, what is calibrated, and the FLOPs, found from the sample model's structure."""

from __future__ import annotations

import onnx
import pytest

from app.builder.int8 import graph


@pytest.fixture(scope="module")
def model(artifacts_dir, tmp_path_factory):
    """The sample export as the calibration reads it: pinned to the 640 square."""
    from app.builder.export import export_onnx, square_export

    exported = export_onnx("sample", artifacts_dir=artifacts_dir)
    return onnx.load(str(square_export(exported, tmp_path_factory.mktemp("square"))))


def test_head_tail_is_everything_after_the_last_convs(model):
    tail = set(graph.head_tail_nodes(model))
    nodes = {n.name: n for n in model.graph.node}
    out_producer = next(n for n in model.graph.node if model.graph.output[0].name in n.output)
    assert out_producer.name in tail
    assert {n.op_type for n in nodes.values() if n.name in tail} >= {"Softmax", "Sigmoid", "Concat", "Reshape"}
    # The only Conv in the tail is the DFL's fixed 1x1 conv (no bias, 16 input channels).
    tail_convs = [nodes[t] for t in tail if nodes[t].op_type == "Conv"]
    assert len(tail_convs) == 1 and len(tail_convs[0].input) == 2
    # Nothing upstream of the head's last Convs is in it: no SiLU (Sigmoid → Mul) of the body.
    assert not [t for t in tail if nodes[t].op_type == "Mul" and nodes[t].input[1].endswith("Sigmoid_output_0")]


def test_head_output_convs_are_the_six_box_and_class_convs(model):
    nodes = {n.name: n for n in model.graph.node}
    out_convs = graph.head_output_convs(model)
    assert len(out_convs) == 6 and all(nodes[c].op_type == "Conv" and len(nodes[c].input) == 3 for c in out_convs)
    inits = {i.name: i for i in model.graph.initializer}
    assert sorted(inits[nodes[c].input[1]].dims[0] for c in out_convs) == [2, 2, 2, 64, 64, 64]
    assert set(graph.float_nodes(model)) == set(graph.head_tail_nodes(model)) | set(out_convs)


def test_calibrated_tensors_and_conv_layers(model):
    tail = graph.head_tail_nodes(model)
    tensors = graph.activation_tensors(model, tail)
    assert tensors[0] == "images" and len(tensors) == len(set(tensors))
    produced_in_tail = {o for n in model.graph.node if n.name in set(tail) for o in n.output}
    assert not set(tensors) & produced_in_tail
    every_conv_input = {n.input[0] for n in model.graph.node if n.op_type == "Conv" and n.name not in set(tail)}
    assert every_conv_input <= set(tensors)
    convs = graph.conv_layers(model, graph.float_nodes(model))
    assert len(convs) == 57  # 64 Convs less the DFL's and the head's six last ones


def test_flops_add_up_to_what_ultralytics_reports(model, ultralytics_model):
    from ultralytics.utils.torch_utils import get_flops

    flops = graph.conv_flops(model)
    assert len(flops) == 64
    # Ultralytics counts the whole model (convs dominate) in GFLOPs at 640.
    assert sum(flops.values()) / 1e9 == pytest.approx(get_flops(ultralytics_model.model, 640), rel=0.01)
    first = next(n for n in model.graph.node if n.op_type == "Conv")
    assert flops[first.name] == 2 * 32 * 3 * 3 * 3 * 320 * 320  # 3→32 channels, 3x3, stride 2
