"""Inductor's settings for a torch-cuda package's build (build time only), and the proof of the
CPU's vector instruction sets that inductor makes once per process, run beside the build's
other steps (``cpu_isa_proved_beside``).

A CUDA package's host code is its C++ wrapper alone: it launches the Triton kernels and holds
the weights, and the pipeline replays it inside CUDA graphs (``app.backends.torch_cuda``), so
its host code does not run per batch. So its build needs neither the wrapper optimised nor the
CPU's best vector instructions proven (``CUDA_INDUCTOR_CONFIGS``). The H100 probe of the build
from the tuning cache (bench/results/2026-12-06-nvidia-h100-build-probe.json) measured:

- the wrapper's compiles (``compile_file``) 12.7-13.3 s at inductor's default -O1 with a
  precompiled header, 6.8-7.0 s at -O0 without one (a header is precompiled for one compile);
- ``pick_vec_isa`` inside ``AotCodeCompiler.compile``: about 10 s beyond those compiles with
  ``cpp.vec_isa_ok`` set (without it, ``valid_vec_isa_list()`` alone took 36.47 s on that image:
  bench/results/2026-12-06-nvidia-h100-imports-probe.json). That setting answers the base check
  of each set, but inductor still
  builds and loads a test library for AVX-512's VNNI and BF16 and for AMX where the CPU lists
  them, each loaded in a child interpreter that imports torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

# Every convolution and matrix product a Triton template, tuned at build time
# (app.builder.torch_build's docstring: batch-invariant kernels), without inductor's report of
# each tuning on stderr: some 430 lines of tables in a first build, which buried the build's own
# progress lines (the timings are kept in the tuning cache).
# Epilogues (bias and SiLU after a template): inductor's fusion log on the H100 showed most of
# them refused as "no shared data" with their template (its memory-dependency match fails, so
# they ran as kernels of their own, 3.4 ms of the 9.5 ms a batch of 64 took); aggressive_fusion
# skips that test, and the profiler's device time per batch of 64 fell from 9.46 to 9.33 ms
# (pointwise 3.42 -> 3.13 ms; bench/results/2026-12-07-nvidia-h100-pools-fusion-kernel-ab.json,
# where the package with it is 1.03x cuDNN at batch 64). benchmark_epilogue_fusion off made no
# difference to the device time by itself (9.48 ms either way); with it off, a template's choice
# is made when it is lowered, not deferred to a timing of each fused epilogue.
INVARIANT_INDUCTOR_CONFIGS = {"max_autotune": True, "max_autotune_gemm_backends": "TRITON",
                              "max_autotune_conv_backends": "TRITON", "autotune_num_choices_displayed": 0,
                              "max_autotune_report_choices_stats": False, "benchmark_epilogue_fusion": False,
                              "aggressive_fusion": True}
# A CUDA package (module docstring): the vector sets as /proc/cpuinfo lists them, the wrapper
# compiled at -O0 without a precompiled header.
CUDA_INDUCTOR_CONFIGS = {"cpp.vec_isa_ok": True, "aot_inductor.compile_wrapper_opt_level": "O0",
                         "aot_inductor.precompile_headers": False}
ISA_THREAD_NAME = "yolopipe-inductor-vec-isa"


def inductor_configs(batch_invariant: bool, cuda: bool = False) -> dict[str, Any]:
    """The settings ``aoti_compile_and_package`` gets: ``batch_invariant`` (CUDA only) makes every
    convolution and matrix product a Triton template; ``cuda``, a package whose kernels all run
    on the GPU."""
    return {**(CUDA_INDUCTOR_CONFIGS if cuda else {}), **(INVARIANT_INDUCTOR_CONFIGS if batch_invariant else {})}


def settings_text(batch_invariant: bool, cuda: bool) -> str:
    """How a package was compiled, for its manifest."""
    return (f"aoti_compile_and_package, {inductor_configs(batch_invariant, cuda) or 'default settings'}; "
            "linked by app.builder.aoti_link")


@contextlib.contextmanager
def cpu_isa_proved_beside(cuda: bool) -> Iterator[None]:
    """For a CUDA build: inductor's list of the CPU's vector sets (``valid_vec_isa_list``, which
    inductor keeps for the process) made in a thread from the start of this block, under
    ``CUDA_INDUCTOR_CONFIGS``, so that its test libraries and child interpreters run while this
    thread exports and lowers the model; the C++ wrapper's compile then finds the list made.
    The settings hold for the block, in this thread and in that one (which runs in a copy of
    this thread's context: torch keeps them in context variables), and that thread is waited for
    at the block's end when the block succeeds. Another torch, without that
    list, or a failure in the thread: nothing is done ahead, and the compile proves what it
    needs itself, as it would have."""
    if not cuda:
        yield
        return
    from torch._inductor import config

    try:
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    except ImportError:
        valid_vec_isa_list = None

    def prove() -> None:
        with contextlib.suppress(Exception):  # the compile proves it again and says what failed
            valid_vec_isa_list()

    with config.patch(CUDA_INDUCTOR_CONFIGS):
        thread = None
        if valid_vec_isa_list is not None:  # in this context: a torch whose settings are context variables
            thread = threading.Thread(target=contextvars.copy_context().run, args=(prove,), name=ISA_THREAD_NAME,
                                      daemon=True)
            thread.start()
        yield
        if thread is not None:
            thread.join()
