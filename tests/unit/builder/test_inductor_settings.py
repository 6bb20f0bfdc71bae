"""Inductor's settings for a torch-cuda package's build, and the proof of the CPU's vector
instruction sets made beside the build (``app.builder.inductor_settings``), against this torch's
inductor."""

from __future__ import annotations

import threading

import pytest

from app.builder import inductor_settings
from app.builder.inductor_settings import CUDA_INDUCTOR_CONFIGS, cpu_isa_proved_beside, inductor_configs

torch = pytest.importorskip("torch")


def test_every_setting_is_one_this_torch_knows_and_a_cuda_package_gets_them_all():
    from torch._inductor import config

    for invariant in (False, True):
        with config.patch(inductor_configs(invariant, cuda=True)):  # an unknown name raises here
            assert config.cpp.vec_isa_ok is True
            assert config.aot_inductor.compile_wrapper_opt_level == "O0"
            assert config.aot_inductor.precompile_headers is False
            assert config.max_autotune is invariant
            # a tuning build reports nothing of its own on stderr (the build's lines say how far it is)
            assert (config.autotune_num_choices_displayed == 0) is invariant
            assert config.max_autotune_report_choices_stats is not invariant
            # epilogues fused wherever inductor can, not left to one timing (inductor's default),
            # and past its shared-data test, which refused most of them with their templates
            assert config.benchmark_epilogue_fusion is not invariant
            assert config.aggressive_fusion is invariant
    assert inductor_configs(False) == {} and inductor_configs(False, cuda=True) == CUDA_INDUCTOR_CONFIGS
    assert "'aot_inductor.compile_wrapper_opt_level': 'O0'" in inductor_settings.settings_text(True, cuda=True)
    assert "default settings" in inductor_settings.settings_text(False, cuda=False)


def test_a_cuda_build_takes_the_base_vector_sets_without_building_a_test_library(monkeypatch):
    """Under a CUDA package's settings, inductor trusts the CPU's base vector sets as listed
    instead of compiling and loading a test library for each (a child interpreter importing
    torch per set); by default it proves them by a build."""
    import torch._inductor.config
    from torch._inductor import cpu_vec_isa

    def refused(self, code):
        raise AssertionError("a test library was built")

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", refused)
    cpu_vec_isa.VecISA._VecISA__bool__impl.cache_clear()  # answers an earlier build proved
    isa = cpu_vec_isa.VecAVX2()
    with torch._inductor.config.patch(inductor_configs(True, cuda=True)):
        assert bool(isa) is True
    with torch._inductor.config.patch(inductor_configs(True)), pytest.raises(AssertionError, match="library"):
        bool(isa)


def test_the_extensions_of_avx512_are_proven_by_a_build_whatever_the_settings(monkeypatch):
    """Why the list is made beside the build: AVX-512's BF16 (and VNNI, AMX) are each proven by
    a test library even under ``cpp.vec_isa_ok`` (this torch, a CPU that lists them)."""
    import torch._inductor.config
    from torch._inductor import cpu_vec_isa

    if not (torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported()):
        pytest.skip("this CPU lists no AVX-512 BF16")
    built = []
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda self, code: built.append(code) or True)
    isa = cpu_vec_isa.VecAVX512()  # a fresh instance: its answer is kept per instance
    with torch._inductor.config.patch(CUDA_INDUCTOR_CONFIGS):
        assert bool(isa) is True
    assert len(built) == 1 and "_mm512_cvtne2ps_pbh" in built[0]


def test_the_list_is_made_in_a_thread_while_the_block_runs_under_the_cuda_settings(monkeypatch):
    from torch._inductor import config, cpu_vec_isa

    started, release, seen = threading.Event(), threading.Event(), []

    def making():
        seen.append((threading.current_thread().name, config.cpp.vec_isa_ok,
                     config.aot_inductor.compile_wrapper_opt_level))
        started.set()
        assert release.wait(10)
        return ["the list"]

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", making)
    before = config.cpp.vec_isa_ok, config.aot_inductor.compile_wrapper_opt_level
    with cpu_isa_proved_beside(cuda=True):
        assert started.wait(10)  # made while this thread goes on with the build
        assert seen == [(inductor_settings.ISA_THREAD_NAME, True, "O0")]
        assert config.cpp.vec_isa_ok is True
        release.set()
    assert not any(t.name == inductor_settings.ISA_THREAD_NAME for t in threading.enumerate())  # waited for
    assert (config.cpp.vec_isa_ok, config.aot_inductor.compile_wrapper_opt_level) == before


def test_a_failed_proof_a_failed_build_and_a_cpu_build_leave_nothing_behind(monkeypatch):
    from torch._inductor import config, cpu_vec_isa

    calls = []

    def broken():
        calls.append(threading.current_thread().name)
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", broken)
    before = config.cpp.vec_isa_ok
    with cpu_isa_proved_beside(cuda=True):  # the compile proves it again and says what failed
        pass
    assert calls == [inductor_settings.ISA_THREAD_NAME] and config.cpp.vec_isa_ok == before
    with pytest.raises(ValueError, match="the export failed"), cpu_isa_proved_beside(cuda=True):
        raise ValueError("the export failed")
    assert config.cpp.vec_isa_ok == before
    for thread in threading.enumerate():  # not waited for after a failure: it ends on its own
        if thread.name == inductor_settings.ISA_THREAD_NAME:
            thread.join(10)
    calls.clear()
    with cpu_isa_proved_beside(cuda=False):
        assert config.cpp.vec_isa_ok == before
    assert calls == []


PICK = """
import json, sys
from torch._inductor import config, cpu_vec_isa
from app.builder.inductor_settings import CUDA_INDUCTOR_CONFIGS, cpu_isa_proved_beside
if sys.argv[1] == "beside":
    with cpu_isa_proved_beside(cuda=True):
        pass
made = cpu_vec_isa.valid_vec_isa_list.cache_info().misses
with config.patch(CUDA_INDUCTOR_CONFIGS):
    picked = str(cpu_vec_isa.pick_vec_isa())
print(json.dumps({"made_before": made, "made": cpu_vec_isa.valid_vec_isa_list.cache_info().misses, "picked": picked}))
"""


def test_the_compile_finds_the_list_made_beside_it_and_picks_what_it_would_have(tmp_path):
    """This torch's own proofs (test libraries, child interpreters), in fresh processes with
    fresh inductor folders: the list made in the thread is the one the compile then reads, and
    it picks the set it picks without it."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(inductor_settings.__file__).resolve().parents[2])
    found = {}
    for how in ("beside", "in-the-compile"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / how),
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run([sys.executable, "-c", PICK, how], capture_output=True, text=True, env=env,
                              timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        found[how] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["beside"]["made_before"] == found["beside"]["made"] == 1  # made once, before the compile asked
    assert found["in-the-compile"]["made_before"] == 0 and found["in-the-compile"]["made"] == 1
    assert found["beside"]["picked"] == found["in-the-compile"]["picked"] != ""
