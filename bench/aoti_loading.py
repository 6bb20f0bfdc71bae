"""Why an AOTInductor package crashes a fresh process, and what its load time is spent on.

On a GPU machine: builds a toy package (Conv2d + ReLU, fp16, dynamic batch) once with inductor's
default link line and once with ``app.builder.aoti_link``'s (static archives kept private to the
library), then loads each in fresh processes several ways (the package loader, or the
container runner on the extracted library; plain, with the system's libstdc++ preloaded, or with
it opened globally before ``import torch``). Records for each: exit (a signal is a crash), the
seconds of each step, and for the plain crash which shared objects the package library's C++
symbols bind to (``LD_DEBUG=bindings``). A slow load is sampled with ``py-spy dump --native``
when py-spy is on PATH.

    python bench/aoti_loading.py --out bench/results/DATE-MACHINE-aoti-loading.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

BUILD = """
import contextlib, os, sys, time
import torch
from app.builder.aoti_link import linking
t0 = time.perf_counter()
m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).cuda().half().eval()
x = torch.rand(2, 3, 64, 64, device="cuda", dtype=torch.half)
ep = torch.export.export(m, (x,), dynamic_shapes=({0: torch.export.Dim("b", min=1, max=8)},))
with linking() if sys.argv[2] == "yolopipe" else contextlib.nullcontext():
    torch._inductor.aoti_compile_and_package(ep, package_path=sys.argv[1])
print("built", round(time.perf_counter() - t0, 1))
"""

LOAD = """
import ctypes, faulthandler, json, os, sys, time
t0 = time.perf_counter()
mode, how, target = sys.argv[1], sys.argv[2], sys.argv[3]
faulthandler.dump_traceback_later(15, repeat=True)
if mode == "ctypes-global":
    ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
def maps():
    names = set()
    for line in open("/proc/self/maps"):
        p = line.split()[-1]
        if "stdc++" in p or "libtorch_cpu" in p:
            names.add(p)
    return sorted(names)
before = maps()
import torch
t_import = time.perf_counter()
after = maps()
torch.zeros(1, device="cuda")
t_ctx = time.perf_counter()
print("loading", flush=True)
if how == "loader":
    loader = torch._C._aoti.AOTIModelPackageLoader(target, "model", True, 1, 0)
    run = lambda x: loader.boxed_run([x])[0]
else:
    so, cubins = target.split(":")
    try:
        runner = torch._C._aoti.AOTIModelContainerRunnerCuda(so, 1, "cuda:0", cubins)
    except TypeError:
        runner = torch._C._aoti.AOTIModelContainerRunnerCuda(so, 1, "cuda:0")
    run = lambda x: runner.run([x])[0]
t_load = time.perf_counter()
x = torch.rand(4, 3, 64, 64, device="cuda", dtype=torch.half)
y = run(x)
torch.cuda.synchronize()
t_run = time.perf_counter()
print(json.dumps({"ok": True, "shape": list(y.shape), "libstdcxx_before_torch": before,
                  "libstdcxx_after_torch": after, "import_s": round(t_import - t0, 2),
                  "context_s": round(t_ctx - t_import, 2), "load_s": round(t_load - t_ctx, 2),
                  "first_run_s": round(t_run - t_load, 2)}))
"""


def sh(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, check=False).stdout.strip()


def facts() -> dict:
    py = sys.executable
    return {
        "python": py, "version": sys.version.split()[0],
        "gxx": sh("g++ --version | head -1"), "cxx_env": os.environ.get("CXX"),
        "python_needs": sh(f"ldd {py} | grep -E 'stdc|python'"),
        "libstdcxx_in_ld_cache": sh("ldconfig -p | grep stdc++"),
        "libstdcxx_files": sh("find / -xdev -name 'libstdc++.so*' 2>/dev/null | head -20"),
        "as_needed_default": sh("g++ -dumpspecs | grep -c as-needed"),
        "torch_built_with": sh("python3 -c 'import torch, pathlib; print(pathlib.Path(torch.__file__).parent)'"
                               " | xargs -I{} sh -c 'strings -a {}/lib/libtorch_cpu.so | grep -m2 \"GCC: (\"'"),
    }


def package_facts(pt2: Path, into: Path) -> dict:
    with zipfile.ZipFile(pt2) as zf:
        names = zf.namelist()
        zf.extractall(into)
    so = next(into.rglob("*.so"))
    wrapper = next(iter(into.rglob("*wrapper.cpp")), None)
    link = ""
    if wrapper is not None:
        text = wrapper.read_text(errors="replace")
        found = re.findall(r"// Link cmd\n// (.*)", text)
        link = found[-1] if found else ""
    return {"files": len(names), "so": str(so), "cubin_dir": str(so.parent),
            "needed": re.findall(r"\[(.*?)\]", sh(f"readelf -d {so} | grep NEEDED")),
            "exported_std_symbols": int(sh(f"nm -D --defined-only {so} | grep -c ' _ZNSt\\| _ZSt' || true") or 0),
            "link_cmd": link[:3000]}


def load(mode: str, how: str, target: str, env: dict, timeout: float, spy: bool) -> dict:
    env = dict(env)
    if mode == "preload":
        lib = sh("ldconfig -p | awk '/libstdc\\+\\+.so.6 .*x86-64/ {print $NF; exit}'")
        env["LD_PRELOAD"] = lib
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", LOAD, mode, how, target], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    dumps: list[str] = []
    if spy and shutil.which("py-spy"):
        def sample() -> None:
            for delay in (8, 20):
                time.sleep(delay - (time.monotonic() - started) if delay > time.monotonic() - started else 0)
                if proc.poll() is not None:
                    return
                dumps.append(sh(f"py-spy dump --native --pid {proc.pid} 2>&1 | head -60"))
        threading.Thread(target=sample, daemon=True).start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    row = {"mode": mode, "how": how, "exit": proc.returncode, "wall_s": round(time.monotonic() - started, 1)}
    result = [line for line in out.splitlines() if line.startswith("{")]
    if result:
        row.update(json.loads(result[-1]))
    else:
        row["stderr_tail"] = err[-2500:]
    if dumps:
        row["py_spy"] = dumps
    return row


def bindings(target: str, env: dict) -> dict:
    """Which objects the package library's libstdc++ symbols bind to, in a plain (crashing) load."""
    env = {**env, "LD_DEBUG": "bindings"}
    proc = subprocess.run([sys.executable, "-c", LOAD, "plain", "runner", target], capture_output=True,
                          text=True, env=env, timeout=300, check=False)
    to: collections.Counter = collections.Counter()
    samples: dict[str, list[str]] = collections.defaultdict(list)
    for line in proc.stderr.splitlines():
        m = re.search(r"binding file (\S+) \[\d+\] to (\S+) \[\d+\]: normal symbol `([^']+)'", line)
        if not m or "wrapper" not in m.group(1) or not m.group(3).startswith(("_ZNSt", "_ZSt", "_ZNKSt")):
            continue
        lib = Path(m.group(2)).name
        to[lib] += 1
        if len(samples[lib]) < 12:
            samples[lib].append(m.group(3))
    return {"exit": proc.returncode, "std_symbols_bound_to": dict(to), "samples": dict(samples)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--timeout", type=float, default=150.0)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aoti-loading-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    report: dict = {"facts": facts(), "packages": {}, "loads": []}

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")

    save()
    for link in ("default", "yolopipe"):
        pt2 = work / f"toy-{link}.pt2"
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", BUILD, str(pt2), link], capture_output=True, text=True,
                              env={**env, "TORCHINDUCTOR_CACHE_DIR": str(work / f"cache-{link}")}, timeout=600,
                              check=False)
        info = {"build_exit": proc.returncode, "build_wall_s": round(time.monotonic() - started, 1)}
        if proc.returncode == 0:
            info.update(package_facts(pt2, work / f"x-{link}"))
        else:
            info["stderr_tail"] = proc.stderr[-2500:]
        report["packages"][link] = info
        save()
        print(json.dumps({link: info})[:1500], flush=True)
    plan = [("default", "plain", "runner"), ("default", "preload", "runner"), ("default", "ctypes-global", "runner"),
            ("yolopipe", "plain", "runner"), ("yolopipe", "plain", "loader"),
            ("default", "preload", "loader")]
    for link, mode, how in plan:
        info = report["packages"].get(link, {})
        if "so" not in info:
            continue
        target = str(work / f"toy-{link}.pt2") if how == "loader" else f"{info['so']}:{info['cubin_dir']}"
        row = {"package": link, **load(mode, how, target, env, args.timeout, spy=how == "loader")}
        report["loads"].append(row)
        save()
        print(json.dumps(row)[:1500], flush=True)
    if "so" in report["packages"].get("default", {}):
        info = report["packages"]["default"]
        report["bindings_default_plain"] = bindings(f"{info['so']}:{info['cubin_dir']}", env)
        save()
        print(json.dumps(report["bindings_default_plain"])[:3000], flush=True)


if __name__ == "__main__":
    main()
