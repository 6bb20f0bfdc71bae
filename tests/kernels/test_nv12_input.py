"""How the GPU pipeline lays a batch of device NV12 frames out in a slot's staging
(``app.gpu.nv12_input``), run through the NV12 letterbox kernel in the simulator: each frame
copied as its byte range at its planned offset (what ``copy_frames`` does on the device), the
params written by ``write_params`` into the header region the H2D copy carries, the bucket's
padding slots empty. The device copies themselves run on a GPU only (tests/gpu/test_nvdec.py)."""

from __future__ import annotations

import numpy as np
import pytest

from app.errors import InvalidImage
from app.imaging.letterbox import PAD_VALUE
from app.imaging.yuv import swscale_constants
from tests.nv12 import surface
from tests.videos import clip_frames

cuda = pytest.importorskip("numba.cuda")
from app.contracts import DeviceNv12
from app.gpu.nv12 import launch_nv12_letterbox
from app.gpu.nv12_input import (
    Nv12Layout,
    check_layout,
    checked_frames,
    params_view,
    plan_nv12,
    write_params,
)

SIZE = 32
MAX_BATCH = 4
HEADER_BYTES = 256  # an image params header before the NV12 params, as in a slot's staging


def test_a_batch_laid_out_in_the_staging_equals_opencv(assets_dir):
    clip = clip_frames(assets_dir, 12)
    surfaces = [surface(clip[0], 36, 64, pitch=96, size=SIZE), surface(clip[11], 21, 33, pitch=40, size=SIZE,
                                                                      colour=swscale_constants(1)),
                surface(clip[5], 48, 40, size=SIZE, colour=swscale_constants(6, True))]
    layouts = [Nv12Layout(s.coded.shape[0], s.coded.shape[1], s.pitch) for s in surfaces]
    plan = plan_nv12(HEADER_BYTES, MAX_BATCH, SIZE, [(k, None, layout, s.height, s.width, s.colour)
                                                     for k, (s, layout) in enumerate(zip(surfaces, layouts))])
    assert plan.host_end <= plan.placed[0][2], "the H2D copy stops before the first frame"
    staging = np.full(plan.end, 123, np.uint8)  # junk wherever nothing is written
    for (_, _, offset, layout), s in zip(plan.placed, surfaces):
        assert offset % 256 == 0
        staging[offset : offset + layout.span] = s.bytes[: layout.span]  # the one copy per frame
    write_params(staging, HEADER_BYTES, MAX_BATCH, plan, MAX_BATCH)  # bucket 4: one padding slot
    params = cuda.to_device(np.ascontiguousarray(params_view(staging, HEADER_BYTES, MAX_BATCH)))
    out = cuda.device_array((MAX_BATCH, 3, SIZE, SIZE), np.float32)
    launch_nv12_letterbox(cuda.to_device(staging), params, out, MAX_BATCH)
    got = out.copy_to_host()
    for k, s in enumerate(surfaces):
        np.testing.assert_array_equal(got[k], s.reference(), f"frame {k}")
    assert np.all(got[3] == np.float32(PAD_VALUE) / np.float32(255)), "the bucket's padding slot"


@pytest.mark.parametrize(("layout", "height", "width", "why"), [
    (Nv12Layout(30, 20, 20), 20, 20, ""),
    (Nv12Layout(30, 20, 32), 19, 19, ""),  # an odd picture in an even surface
    (Nv12Layout(31, 20, 20), 20, 20, "rows = 3/2"),
    (Nv12Layout(30, 20, 20), 21, 20, "does not fit"),
    (Nv12Layout(30, 20, 20), 20, 21, "does not fit"),  # its last column's chroma pair is not there
    (Nv12Layout(30, 20, 16), 20, 16, "contiguous"),  # a pitch under the width
])
def test_layout_checks(layout, height, width, why):
    if not why:
        check_layout(layout, height, width)
        return
    with pytest.raises(InvalidImage, match=why):
        check_layout(layout, height, width)


def test_a_batch_of_device_frames_holds_nothing_else():
    torch = pytest.importorskip("torch")
    results: list = [None] * 3
    host_planes = DeviceNv12(torch.zeros((30, 20), dtype=torch.uint8), 20, 20)  # on the host, not the device
    frames = checked_frames([np.zeros((20, 20, 3), np.uint8), b"\xff\xd8", host_planes], 0, results)
    assert frames == []
    assert all(isinstance(r, InvalidImage) for r in results)
    assert "holds nothing else" in str(results[0]) and "cuda:0" in str(results[2])
