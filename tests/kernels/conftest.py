"""Kernel tests run under Numba's CUDA simulator unless YOLOPIPE_REAL_GPU=1.

The simulator must be chosen before numba.cuda is first imported, so this is set at
conftest import, ahead of the test modules. On the GPU machine run with YOLOPIPE_REAL_GPU=1
to execute the same tests on the device.
"""

from __future__ import annotations

import os

if os.environ.get("YOLOPIPE_REAL_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
