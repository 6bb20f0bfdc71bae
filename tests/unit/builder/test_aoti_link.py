"""The package library's link (``app.builder.aoti_link``): the compiler script, and for real on the
CPU, a toolchain that links its C++ runtime statically (as the H200's ``/opt/gcc/bin/g++`` does):
without the fix its package fails to load in a fresh process, with it the package loads and runs
like the model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.builder.aoti_link import LINK_FLAGS, write_script

ROOT = Path(__file__).resolve().parents[3]


def fake_compiler(folder: Path) -> tuple[Path, Path]:
    """A 'compiler' that writes the arguments it was given, one call a line."""
    log = folder / "calls.txt"
    real = folder / "real" / "g++"
    real.parent.mkdir(parents=True)
    real.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    real.chmod(0o755)
    return real, log


def test_the_script_adds_the_flags_to_the_shared_library_link_only(tmp_path):
    real, log = fake_compiler(tmp_path)
    script = write_script(tmp_path / "wrap", str(real))
    assert script.name == "g++"  # inductor reads the compiler's kind from its name too
    calls = [["--version"], ["-c", "w.cpp", "-shared", "-fPIC", "-o", "w.o"], ["w.o", "k.o", "-shared", "-o", "w.so"],
             ["main.o", "-o", "main"], ["a b.o", "-shared", "-o", "with space.so"]]
    for args in calls:
        subprocess.run([str(script), *args], check=True)
    lines = log.read_text().splitlines()
    flags = " ".join(LINK_FLAGS)
    assert lines == ["--version", "-c w.cpp -shared -fPIC -o w.o", f"w.o k.o -shared -o w.so {flags}", "main.o -o main",
                     f"a b.o -shared -o with space.so {flags}"]


BUILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from app.builder.torch_build import compile_package, export_program
    from app.artifacts.torch_engines import TorchEngineKey
    from tests.unit.builder.test_torch_build_aoti import TinyHead
    out, fixed = Path(sys.argv[1]), sys.argv[2] == "fixed"
    torch.manual_seed(0)
    model = TinyHead().eval()
    key = TorchEngineKey("0" * 64, 32, "fp32", torch.__version__, "cpu", "", 1, 4)
    program = export_program(model, torch.rand(2, 3, 32, 32), key)
    if fixed:
        compile_package(program, out)  # the product's build: app.builder.aoti_link
    else:
        import torch._inductor, os
        with torch._inductor.config.patch({"cpp.cxx": (os.environ["CXX"],)}):
            torch._inductor.aoti_compile_and_package(program, package_path=str(out))
    torch.save(model.state_dict(), out.with_suffix(".weights"))
""")

LOAD = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from app.gpu.torch_model import load_package
    from tests.unit.builder.test_torch_build_aoti import TinyHead
    out = Path(sys.argv[1])
    model = TinyHead().eval()
    model.load_state_dict(torch.load(out.with_suffix(".weights")))
    run = load_package(out, torch.device("cpu"))
    with torch.inference_mode():
        for batch in (1, 3):
            x = torch.rand(batch, 3, 32, 32)
            torch.testing.assert_close(run(x), model(x), rtol=1e-5, atol=1e-5)
    print("loaded and ran")
""")


def static_runtime_toolchain(folder: Path) -> Path:
    """A g++ that links libstdc++ into shared libraries statically, as the H200's toolchain does."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ on this machine")
    probe = folder / "probe"
    probe.mkdir()
    (probe / "p.cpp").write_text("#include <regex>\nbool f(const char* s) { return std::regex_match(s, std::regex(\"a+\")); }\n")
    if subprocess.run([gxx, "-shared", "-fPIC", "-static-libstdc++", str(probe / "p.cpp"), "-o", str(probe / "p.so")],
                      capture_output=True, check=False).returncode != 0:
        pytest.skip("g++ cannot link libstdc++ statically here (no libstdc++.a)")
    script = folder / "static-toolchain" / "g++"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for arg in "$@"; do case "$arg" in -c) exec {gxx} "$@" ;; esac; done
        case " $* " in *" -shared "*) exec {gxx} "$@" -static-libstdc++ ;; esac
        exec {gxx} "$@"
        """))
    script.chmod(0o755)
    return script


@pytest.mark.slow
def test_a_package_linked_with_a_static_cxx_runtime_loads_in_a_fresh_process_only_with_the_fix(tmp_path):
    pytest.importorskip("torch")
    toolchain = static_runtime_toolchain(tmp_path)
    env = {**os.environ, "CXX": str(toolchain), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                           os.environ.get("PYTHONPATH")]))}
    results = {}
    for how in ("fixed", "plain"):  # plain: inductor's own link line
        out = tmp_path / f"{how}.pt2"
        # The wrapper at -O0, one compile process, at the lowest priority: the link is what is
        # tested, and the test processes beside it (servers killed and timed) keep their CPU.
        build_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"cache-{how}"),
                     "AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL": "O0", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        built = subprocess.run([sys.executable, "-c", BUILD, str(out), how], env=build_env, cwd=ROOT,
                               preexec_fn=lambda: os.nice(19),  # the compile yields to the timing tests beside it
                               capture_output=True, text=True, timeout=540, check=False)
        assert built.returncode == 0, built.stderr[-3000:]
        loaded = subprocess.run([sys.executable, "-c", LOAD, str(out)], env=env, cwd=ROOT, capture_output=True,
                                text=True, timeout=120, check=False)
        results[how] = (loaded.returncode, (loaded.stdout + loaded.stderr)[-600:])
    assert results["fixed"][0] == 0 and "loaded and ran" in results["fixed"][1], results["fixed"]
    # The same toolchain without the fix: the container is not created (a SIGSEGV on the H200).
    assert results["plain"][0] != 0, results["plain"]
    assert "loaded and ran" not in results["plain"][1]
