"""The facts every result file records: the machine it ran on and the library versions."""

from __future__ import annotations

import datetime as dt
import os
import platform
import shutil
import subprocess
from pathlib import Path

from app.versions import package_versions

PACKAGES = (
    "yolopipe", "torch", "torchvision", "ultralytics", "onnx", "onnxruntime", "numba", "numba-cuda", "numpy",
    "opencv-python-headless", "opencv-python", "tensorrt", "tensorrt-cu12", "tensorrt-cu13",
    "cupy-cuda12x", "cupy-cuda13x", "nvidia-nvimgcodec-cu12", "nvidia-nvimgcodec-cu13", "fastapi", "uvicorn",
    "starlette", "httpx",
)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def nvidia_smi(fields: str = "name,driver_version,memory.total") -> list[str]:
    """One CSV line per GPU, or [] where there is no NVIDIA driver."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.strip().splitlines() if out.returncode == 0 else []


def machine_info(gpu: bool = False) -> dict:
    info = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": nvidia_smi(),
    }
    if gpu:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    return package_versions(packages)


def code_revision() -> str | None:
    """The yolopipe commit a result was measured on: ``BENCH_COMMIT`` where the command gives it
    (a copy of a tree over a git history not its own, as on the GPU machine), else this checkout's
    (``-dirty`` with changes), None outside a checkout (an installed package)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=False)
    if head.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return head.stdout.strip() + ("-dirty" if dirty else "")


def result_header(script: str, *, gpu: bool = False) -> dict:
    """What a result file says first: the script that wrote it, when, on what, with which versions."""
    return {"what": f"{script} (see its docstring)",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(gpu), "versions": versions(), "code": code_revision()}
