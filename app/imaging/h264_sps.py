"""The colour description of an H.264 stream, read from its sequence parameter set (SPS).

FFmpeg's decoder gives each frame the SPS's ``matrix_coefficients`` (an AVColorSpace code) and
``video_full_range_flag``; OpenCV's conversion follows them (``app.imaging.yuv``). NVDEC hands
over only the pixels, so the NVDEC readers read the same two fields here, from the first SPS in
the compressed packets (Annex B: NAL units after ``00 00 01`` start codes), as the ITU-T H.264
syntax lays them out (7.3.2.1.1 and E.1.1).
"""

from __future__ import annotations

UNSPECIFIED = (2, False)  # no SPS colour description: AVCOL_SPC_UNSPECIFIED, limited range
_HIGH_PROFILES = {100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135}  # these carry chroma/bit-depth fields


class _Bits:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def u(self, n: int) -> int:
        value = 0
        for _ in range(n):
            byte = self.data[self.pos >> 3]  # IndexError past the end: a truncated SPS
            value = (value << 1) | ((byte >> (7 - (self.pos & 7))) & 1)
            self.pos += 1
        return value

    def ue(self) -> int:
        zeros = 0
        while self.u(1) == 0:
            zeros += 1
            if zeros > 31:
                raise ValueError("exp-Golomb code over 32 bits")
        return (1 << zeros) - 1 + self.u(zeros)

    def se(self) -> int:
        k = self.ue()
        return (k + 1) // 2 if k & 1 else -(k // 2)


def _unescape(nal: bytes) -> bytes:
    """The RBSP: ``00 00 03`` emulation-prevention bytes taken out."""
    return nal.replace(b"\x00\x00\x03", b"\x00\x00")


def nal_units(data: bytes) -> list[bytes]:
    """The NAL units of Annex B ``data`` (each without its start code)."""
    units, start = [], data.find(b"\x00\x00\x01")
    while start >= 0:
        begin = start + 3
        nxt = data.find(b"\x00\x00\x01", begin)
        end = len(data) if nxt < 0 else nxt
        units.append(data[begin:end].rstrip(b"\x00") if nxt >= 0 else data[begin:end])
        start = nxt
    return units


def sps_colour(sps: bytes) -> tuple[int, bool]:
    """``(matrix_coefficients, full_range)`` of one SPS NAL unit (header byte included)."""
    r = _Bits(_unescape(sps[1:]))
    profile = r.u(8)
    r.u(16)  # constraint flags, level_idc
    r.ue()  # seq_parameter_set_id
    if profile in _HIGH_PROFILES:
        chroma_format = r.ue()
        if chroma_format == 3:
            r.u(1)  # separate_colour_plane_flag
        r.ue(), r.ue()  # bit depths
        r.u(1)  # qpprime_y_zero_transform_bypass_flag
        if r.u(1):  # seq_scaling_matrix_present_flag
            for i in range(8 if chroma_format != 3 else 12):
                if r.u(1):
                    _skip_scaling_list(r, 16 if i < 6 else 64)
    r.ue()  # log2_max_frame_num_minus4
    poc_type = r.ue()
    if poc_type == 0:
        r.ue()
    elif poc_type == 1:
        r.u(1)
        r.se(), r.se()
        for _ in range(r.ue()):
            r.se()
    r.ue()  # max_num_ref_frames
    r.u(1)  # gaps_in_frame_num_value_allowed_flag
    r.ue(), r.ue()  # picture size in macroblocks
    if not r.u(1):  # frame_mbs_only_flag
        r.u(1)
    r.u(1)  # direct_8x8_inference_flag
    if r.u(1):  # frame_cropping_flag
        for _ in range(4):
            r.ue()
    if not r.u(1):  # vui_parameters_present_flag
        return UNSPECIFIED
    if r.u(1) and r.u(8) == 255:  # aspect_ratio_info: Extended_SAR
        r.u(32)
    if r.u(1):  # overscan_info_present_flag
        r.u(1)
    if not r.u(1):  # video_signal_type_present_flag
        return UNSPECIFIED
    r.u(3)  # video_format
    full_range = bool(r.u(1))
    matrix = 2
    if r.u(1):  # colour_description_present_flag
        r.u(16)  # colour_primaries, transfer_characteristics
        matrix = r.u(8)
    return matrix, full_range


def _skip_scaling_list(r: _Bits, size: int) -> None:
    last = nxt = 8
    for _ in range(size):
        if nxt:
            nxt = (last + r.se() + 256) % 256
        last = nxt or last


def stream_colour(packets: list[bytes]) -> tuple[int, bool] | None:
    """The colour description of the first SPS among ``packets`` (Annex B), None if none has one
    (or it does not parse)."""
    for packet in packets:
        for nal in nal_units(packet):
            if nal and nal[0] & 0x1F == 7:
                try:
                    return sps_colour(nal)
                except (IndexError, ValueError):
                    return None
    return None
