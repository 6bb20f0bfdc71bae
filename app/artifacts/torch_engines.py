"""The torch-cuda engine as an artifact: what it was built from and for, and whether it may run here.

Pure logic, no torch or CUDA import: the facts (torch version, GPU) are passed in, so the rules
are tested on any machine. The engine itself is an AOTInductor package (``app.builder.torch_build``
writes it, ``app.backends.torch_cuda`` loads it): the model traced by ``torch.export`` and
compiled ahead of time, so a run that finds one traces and compiles nothing.

In a model's artifacts folder (``app.artifacts.store``)::

    torch-cuda/fp16.b1-64.invariant.pt2    the package: batches 1 to 64 (one dynamic batch dimension),
                                           batch-invariant kernels (``.cudnn``: cuDNN's, per batch size)
    torch-cuda/fp16.b1-64.invariant.json   its manifest, written last: the key below, the package's size
                                           and sha256

A package may run only when its manifest exists, every fact of its key equals this run's, its
batch range covers the run's largest batch, and the package's size and sha256 equal the
manifest's. Anything else is refused with the reason (``Lookup.refused``) and rebuilt:

* other weights or another ``imgsz``: the folder is keyed by both, a copied folder is not;
* another torch version: a package's kernels and wrapper are built against one libtorch ABI;
* another GPU model or compute capability: its kernels (cubins) were compiled and tuned for one;
* no manifest, or a package whose bytes differ from it: a build killed part way.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.artifacts.store import is_temp_name, write_atomically

TORCH_ENGINE_DIR = "torch-cuda"
# Bump when what a package holds changes: older ones are then rebuilt (2: aoti_link; 3: the kernels' kind).
TORCH_ENGINE_FORMAT = 3
PACKAGE_SUFFIX = ".pt2"
MANIFEST_SUFFIX = ".json"
LOCK_NAME = ".build.lock"


@dataclass(frozen=True)
class TorchEngineKey:
    """Everything a package depends on. Two packages with equal keys are interchangeable."""

    weights_sha256: str
    imgsz: int
    precision: str  # fp16 | fp32
    torch_version: str  # torch.__version__ at build time, e.g. "2.11.0+cu130"
    gpu_name: str  # e.g. "NVIDIA H200"
    compute_capability: str  # "major.minor", e.g. "9.0"
    min_batch: int
    max_batch: int  # min == max: a fixed batch; else one dynamic batch dimension over the range
    # True: every convolution and matrix product is one Triton kernel chosen at build time for all
    # batch sizes, so an image's answer does not depend on its batch (app.builder.torch_build).
    # False: cuDNN's and cuBLAS's kernels, which pick their split of the work per batch size.
    batch_invariant: bool = True
    format: int = TORCH_ENGINE_FORMAT

    @property
    def kernels(self) -> str:
        return "invariant" if self.batch_invariant else "cudnn"

    @property
    def stem(self) -> str:
        """The file name without suffix: precision, batch range, kernels. The machine facts are not
        in the name, so a package built elsewhere is found, refused with its reason and replaced."""
        return f"{self.precision}.b{self.min_batch}-{self.max_batch}.{self.kernels}"

    def covers(self, batch: int) -> bool:
        return self.min_batch <= batch <= self.max_batch


@dataclass(frozen=True)
class TorchEngineManifest:
    key: TorchEngineKey
    package_sha256: str
    package_bytes: int
    build_seconds: float = 0.0
    created_at: str = ""
    builder: dict[str, Any] = field(default_factory=dict)  # how it was built (inductor settings), for people

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> TorchEngineManifest:
        data = json.loads(text)
        key = TorchEngineKey(**data.pop("key"))
        return cls(key=key, **data)


@dataclass(frozen=True)
class Lookup:
    """What ``find_torch_engine`` found: a package that may run here (or None), and for every
    other package of this precision why it may not."""

    package: Path | None
    manifest: TorchEngineManifest | None
    refused: list[str]


def engine_dir(model_dir: Path) -> Path:
    return Path(model_dir) / TORCH_ENGINE_DIR


def package_path(model_dir: Path, key: TorchEngineKey) -> Path:
    return engine_dir(model_dir) / f"{key.stem}{PACKAGE_SUFFIX}"


def manifest_path(model_dir: Path, key: TorchEngineKey) -> Path:
    return engine_dir(model_dir) / f"{key.stem}{MANIFEST_SUFFIX}"


def lock_path(model_dir: Path) -> Path:
    return engine_dir(model_dir) / LOCK_NAME


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def save_manifest(model_dir: Path, manifest: TorchEngineManifest) -> Path:
    """Written atomically, and only after the package it describes is in place."""
    return write_atomically(manifest_path(model_dir, manifest.key), manifest.to_json().encode())


def manifest_of(package: Path) -> TorchEngineManifest | None:
    """The manifest beside ``package`` (None: none, or unreadable)."""
    return _read_manifest(Path(package).with_suffix(MANIFEST_SUFFIX))


def _read_manifest(path: Path) -> TorchEngineManifest | None:
    try:
        return TorchEngineManifest.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def mismatch(found: TorchEngineKey, wanted: TorchEngineKey) -> list[str]:
    """Why a package built for ``found`` may not run where ``wanted`` describes (empty: it may)."""
    problems = []
    if found.format != wanted.format:
        problems.append(f"it is of package format {found.format}, this yolopipe reads format {wanted.format}")
    if found.weights_sha256 != wanted.weights_sha256:
        problems.append(f"it was built from other weights (sha256 {found.weights_sha256[:12]}, "
                        f"these are {wanted.weights_sha256[:12]})")
    if found.imgsz != wanted.imgsz:
        problems.append(f"it was built for imgsz {found.imgsz}, this run uses {wanted.imgsz}")
    if found.precision != wanted.precision:
        problems.append(f"it runs {found.precision}, this run wants {wanted.precision}")
    if found.torch_version != wanted.torch_version:
        problems.append(f"torch {found.torch_version} built it, this is torch {wanted.torch_version}")
    if (found.gpu_name, found.compute_capability) != (wanted.gpu_name, wanted.compute_capability):
        problems.append(f"it was built on {found.gpu_name} (compute capability {found.compute_capability}), "
                        f"this GPU is {wanted.gpu_name} ({wanted.compute_capability})")
    return problems


def find_torch_engine(model_dir: Path, wanted: TorchEngineKey, *, verify: bool = True) -> Lookup:
    """The package to load for ``wanted`` (its facts, and ``wanted.max_batch`` as the largest batch
    the run needs), or None with the reasons every candidate was refused. Among packages that
    may run, the narrowest batch range wins. ``verify``: check the package's sha256 too (reads
    it once; without it only the size is compared)."""
    folder = engine_dir(model_dir)
    if not folder.is_dir():
        return Lookup(None, None, [])
    refused: list[str] = []
    usable: list[tuple[int, Path, TorchEngineManifest]] = []
    manifests = {p.stem: p for p in folder.glob(f"{wanted.precision}.b*{MANIFEST_SUFFIX}") if not is_temp_name(p)}
    for package in sorted(folder.glob(f"{wanted.precision}.b*{PACKAGE_SUFFIX}")):
        if is_temp_name(package):
            continue
        label = f"torch-cuda engine {package.name}"
        manifest_file = manifests.get(package.stem)
        manifest = _read_manifest(manifest_file) if manifest_file is not None else None
        # (a package of an older format is named by its own rules: mismatch says so below)
        if manifest is None or (manifest.key.format == wanted.format and manifest.key.stem != package.stem):
            refused.append(f"{label} has no readable manifest (a build that did not finish)")
            continue
        problems = mismatch(manifest.key, wanted)
        if problems:
            refused.append(f"{label} does not fit: " + "; ".join(problems))
            continue
        if not (manifest.key.min_batch <= 1 and manifest.key.max_batch >= wanted.max_batch) \
                or manifest.key.batch_invariant != wanted.batch_invariant:
            continue  # another batch range or kind of kernels: kept for the runs it fits, not a refusal
        size = package.stat().st_size
        if size != manifest.package_bytes or (verify and sha256_of(package) != manifest.package_sha256):
            refused.append(f"{label} differs from its manifest ({size} bytes, the manifest says "
                           f"{manifest.package_bytes}): a build that did not finish")
            continue
        usable.append((manifest.key.max_batch - manifest.key.min_batch, package, manifest))
    if not usable:
        return Lookup(None, None, refused)
    _, package, manifest = min(usable, key=lambda u: u[0])
    return Lookup(package, manifest, refused)


def leftovers(model_dir: Path) -> list[Path]:
    """Temporary files of builds that did not finish, and packages of an older format with their
    manifests (no yolopipe of this format loads them); call with the build lock held."""
    folder = engine_dir(model_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if is_temp_name(p)]
    for manifest_file in folder.glob(f"*{MANIFEST_SUFFIX}"):
        manifest = None if is_temp_name(manifest_file) else _read_manifest(manifest_file)
        if manifest is not None and manifest.key.format != TORCH_ENGINE_FORMAT:
            found += [manifest_file, manifest_file.with_suffix(PACKAGE_SUFFIX)]
    return [p for p in found if p.exists()]
