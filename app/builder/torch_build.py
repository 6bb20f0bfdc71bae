"""The torch-cuda engine, built ahead of time (build time only): an AOTInductor package.

``torch.export`` traces the fused model once (``app.gpu.torch_model``) with one dynamic batch
dimension, and ``torch._inductor.aoti_compile_and_package`` compiles it (Triton kernels, a C++
wrapper, the weights) into one ``.pt2`` file in the model's artifacts folder, keyed and checked by
``app.artifacts.torch_engines``.

Batch-invariant kernels (the default, ``TorchEngineKey.batch_invariant``): cuDNN's convolutions
split their work by the batch's size, so an image's scores moved with the batch it ran in and its
place there (bench/results/2026-12-03-nvidia-h200-issue35-call1-invariance-cudnn.json: one
photo, 9 heads in batches of 1 to 64, up to 1.5 px apart; 2 or 3 among companions at one size).
So every convolution and matrix product is built as one of inductor's Triton templates
(``max_autotune`` with the Triton backends alone), tuned once at build time and then run with
the same tiles and the same order of summation at every batch size. The build checks that: the
package must give an image the same bits alone and anywhere in larger batches, or it is refused
(``app.builder.torch_check``).

A run loads that file (``app.backends.torch_cuda``): no Dynamo tracing, no inductor, no
Ultralytics import at start-up.

A build holds the folder's lock (the service's worker and its standby may start together: one
builds, the other waits and loads), writes the package under a temporary name, checks it
against the eager model, in this process and in a fresh one (what every later run is; it starts
with the build, so its imports run while the build compiles), renames
it into place and writes its manifest last. A failure leaves nothing that a later run would load
and a note of why beside it (``<stem>.refused``: later starts with the same key do not try
again; ``yolopipe build-engine`` does); ``ensure_torch_engine`` then says why and returns None,
and the run uses the eager model in CUDA graphs.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.artifacts.engines import now_iso
from app.artifacts.exports import WEIGHTS_COPY_NAME
from app.artifacts.store import exclusive_lock, publish, temp_name, write_atomically
from app.artifacts.torch_engines import (
    TorchEngineKey,
    TorchEngineManifest,
    engine_dir,
    find_torch_engine,
    leftovers,
    lock_path,
    manifest_path,
    package_path,
    save_manifest,
    sha256_of,
)
from app.artifacts.tuning_cache import default_tuning_cache, say_duration
from app.builder.inductor_settings import cpu_isa_proved_beside, inductor_configs, settings_text
from app.builder.pool_rewrite import rewrite_pools
from app.builder.stem_rewrite import rewrite_stem
from app.builder.torch_check import FreshProcess, batch_variance, fresh_process_check
from app.builder.tuning import expected_build_s, tuned
from app.config import ENGINE_MAX_BATCH
from app.errors import ArtifactError, BackendUnavailable, InvalidParameter
from app.types import ModelMeta

Say = Callable[[str], None]
TORCH_CACHE_DIR = "torch-cache"  # inductor's and Triton's caches, under the model's folder
# A package's head may differ from the eager model's by kernel fusion and reordering only:
# (boxes in input pixels, where fp16 steps by 0.5 near 640; scores), max |difference|.
CHECK_TOLERANCE = {"fp16": (2.0, 0.02), "fp32": (0.05, 1e-3)}
# The batch a dynamic package is traced and tuned at (``example_batch``): predict's, the largest of
# the default range. Tuned at 2, the H100's package ran 1,467 / 4,973 / 5,339 img/s at batches
# 1 / 16 / 64; tuned at 64, 1,344 / 5,611 / 6,053; cuDNN's package 1,632 / 5,860 / 6,667 in the
# same run (bench/results/2026-12-06-nvidia-h100-tuning-batch-probe.json).
TUNING_BATCH = 64


def engine_key(meta: ModelMeta, *, precision: str, max_batch: int, device: int = 0, min_batch: int = 1,
               batch_invariant: bool = True) -> TorchEngineKey:
    """The key of a package for this GPU and torch: what a run looks for, what a build writes."""
    import torch

    from app.gpu.probe import gpu_identity

    gpu_name, capability = gpu_identity(device)
    return TorchEngineKey(meta.weights_sha256, meta.imgsz, precision, torch.__version__, gpu_name, capability,
                          min_batch, max_batch, batch_invariant)


def build_range(max_batch: int) -> int:
    """The largest batch a package is built for: the run's, and at least ``ENGINE_MAX_BATCH``,
    so that runs of other batch sizes (the service's 32, predict's 64) share one package."""
    return max(int(max_batch), ENGINE_MAX_BATCH)


@dataclass(frozen=True)
class BuiltEngine:
    """What a run of one key finds built, without building anything (``built_torch_engine``)."""

    package: tuple[Path, TorchEngineKey] | None  # the package that runs it, with its key
    refusal: str | None  # else: why an earlier build of it failed on this machine (the eager model runs)
    stale: tuple[str, ...]  # packages found that do not fit, each with why
    build: TorchEngineKey  # what a build for this run writes (batches up to ``build_range``)


def built_torch_engine(model_dir: Path, meta: ModelMeta, *, precision: str, max_batch: int, device: int = 0,
                       batch_invariant: bool = True) -> BuiltEngine:
    """The package a run loads (the one built earlier, when it fits this GPU, torch and batch),
    or why there is none; a run's look-up (``app.runtime``), which builds nothing."""
    wanted = engine_key(meta, precision=precision, max_batch=max_batch, device=device, batch_invariant=batch_invariant)
    found = find_torch_engine(model_dir, wanted)
    build = TorchEngineKey(**{**asdict(wanted), "max_batch": build_range(max_batch)})
    if found.package is not None:
        return BuiltEngine((found.package, found.manifest.key), None, (), build)
    return BuiltEngine(None, refusal(model_dir, build), tuple(found.refused), build)


def ensure_torch_engine(model_dir: Path, meta: ModelMeta, *, precision: str, max_batch: int, device: int = 0,
                        batch_invariant: bool = True, say: Say | None = None) -> tuple[Path, TorchEngineKey] | None:
    """The package a run loads: the one built earlier when it fits, else built now. None
    (with a warning) when AOTInductor cannot build one that runs here, now or on an earlier
    start with the same key; the run then uses the eager model."""
    say = say or (lambda text: None)
    found = built_torch_engine(model_dir, meta, precision=precision, max_batch=max_batch, device=device,
                               batch_invariant=batch_invariant)
    if found.package is not None:
        return found.package
    if found.refusal is not None:
        say(f"no torch-cuda engine: {found.refusal} (an earlier build; `yolopipe build-engine` tries again)")
        return None
    for reason in found.stale:
        say(f"rebuilding: {reason}")
        warnings.warn(f"{reason}; building it again", RuntimeWarning, stacklevel=2)
    seconds, why = expected_build_s(default_tuning_cache(model_dir), found.build.gpu_name,
                                    batch_invariant=batch_invariant, device=device,
                                    tuning_batch=example_batch(found.build))
    say(f"no torch-cuda engine built for this GPU yet: building it now, {say_duration(seconds)} ({why}); "
        "`yolopipe build-engine` builds it ahead of time")
    try:
        return build_torch_engine(model_dir, meta, found.build, device=device, say=say), found.build
    except BackendUnavailable as exc:
        varies = " (cuDNN's kernels: an image's answer may vary with its batch)" if batch_invariant else ""
        warnings.warn(f"{exc.message}; running the eager model instead{varies}", RuntimeWarning, stacklevel=2)
        return None


def refusal_path(model_dir: Path, key: TorchEngineKey) -> Path:
    return engine_dir(model_dir) / f"{key.stem}.refused"


def refusal(model_dir: Path, key: TorchEngineKey) -> str | None:
    """Why a build of ``key`` failed on this machine earlier, or None (none did, or for another key)."""
    try:
        note = json.loads(refusal_path(model_dir, key).read_text())
    except (OSError, ValueError):
        return None
    return note.get("reason") if note.get("key") == asdict(key) else None


def build_for_weights(weights: str = "sample", *, precision: str = "fp16", max_batch: int = ENGINE_MAX_BATCH,
                      imgsz: int = 640, artifacts_dir: Path | None = None, device: int = 0,
                      batch_invariant: bool = True, tuning_cache: Path | None = None,
                      say: Say | None = None) -> tuple[Path, bool]:
    """``yolopipe build-engine`` on a GPU without TensorRT: the package for batches 1 to
    ``max_batch``, with the ONNX export (if needed) made beside it (``export_beside``), its
    tunings read from and written to ``tuning_cache`` (default: the model folder's). Returns its
    path and whether it was built now (False: an earlier build fits this GPU and torch)."""
    from app.builder.export import export_beside
    from app.config import MAX_BATCH
    from app.gpu.probe import cuda_device_count

    if precision not in ("fp16", "fp32"):
        raise InvalidParameter(f"the torch-cuda engine runs fp16 or fp32, not {precision}",
                               hint="int8 needs TensorRT: pip install 'yolopipe[tensorrt-cu13]'")
    if not 1 <= max_batch <= MAX_BATCH:
        raise InvalidParameter(f"max batch must be within [1, {MAX_BATCH}], got {max_batch}")
    if cuda_device_count() == 0:
        raise BackendUnavailable("building the torch-cuda engine needs an NVIDIA GPU and none was found")
    with export_beside(weights, imgsz=imgsz, artifacts_dir=artifacts_dir) as export:  # the ONNX export runs beside
        model = export.under_way
        key = engine_key(model.meta, precision=precision, max_batch=max_batch, device=device,
                         batch_invariant=batch_invariant)
        found = find_torch_engine(model.model_dir, key)
        if found.package is not None and found.manifest.key.max_batch == max_batch:
            export.result()
            return found.package, False
        for reason in found.refused:
            (say or (lambda text: None))(f"rebuilding: {reason}")
        built = build_torch_engine(model.model_dir, model.meta, key, device=device, say=say,
                                   tuning_cache=tuning_cache, weights=model.weights)
        export.result()
    return built, True


def build_torch_engine(model_dir: Path, meta: ModelMeta, key: TorchEngineKey, *, device: int = 0,
                       say: Say | None = None, tuning_cache: Path | None = None, weights: Path | None = None) -> Path:
    """Build the package of ``key`` (unless another process just did) and return its path; a
    batch-invariant build reads and writes ``tuning_cache`` (default: the model folder's).
    ``weights``: the checkpoint, where the export has not copied it into ``model_dir`` yet."""
    say = say or (lambda text: None)
    if key.precision not in ("fp16", "fp32"):
        raise InvalidParameter(f"the torch-cuda engine runs fp16 or fp32, not {key.precision}")
    if not 1 <= key.min_batch <= key.max_batch:
        raise InvalidParameter(f"bad batch range {key.min_batch}-{key.max_batch}")
    model_dir = Path(model_dir)
    weights = Path(weights) if weights is not None else model_dir / WEIGHTS_COPY_NAME
    if not weights.is_file():
        raise ArtifactError(f"weights not found: {weights}", hint="run `yolopipe export` first")
    final = package_path(model_dir, key)
    what = f"the torch-cuda engine ({key.precision}, batch {_batches(key)}, {key.kernels} kernels, {key.gpu_name})"
    if _locked_elsewhere(model_dir):
        say(f"waiting for another process building {what}")
    with exclusive_lock(lock_path(model_dir)):
        again = find_torch_engine(model_dir, key)
        if again.package is not None and again.manifest.key == key:
            return again.package  # another process built it while this one waited for the lock
        for stale in leftovers(model_dir):  # a killed build's files: no build runs while the lock is held
            stale.unlink(missing_ok=True)
        started = time.perf_counter()
        tmp = temp_name(final)
        try:
            try:
                with _inductor_cache(model_dir):
                    builder = _compile(weights, meta, key, device, tmp, say, what,
                                       tuning_cache or default_tuning_cache(model_dir))
            except BackendUnavailable as exc:  # noted, so that later starts do not build in vain
                write_atomically(refusal_path(model_dir, key),
                                 json.dumps({"key": asdict(key), "reason": exc.message, "at": now_iso()}).encode())
                raise
            refusal_path(model_dir, key).unlink(missing_ok=True)
            package_sha256, package_bytes = sha256_of(tmp), tmp.stat().st_size
            manifest_path(model_dir, key).unlink(missing_ok=True)  # never an old manifest beside a new package
            publish(tmp, final)
            save_manifest(model_dir, TorchEngineManifest(key, package_sha256, package_bytes,
                                                         round(time.perf_counter() - started, 1), now_iso(), builder))
        finally:
            tmp.unlink(missing_ok=True)
    say(f"{what}: built in {time.perf_counter() - started:.0f} s")
    return final


def _batches(key: TorchEngineKey) -> str:
    return str(key.min_batch) if key.min_batch == key.max_batch else f"{key.min_batch}-{key.max_batch}"


def _locked_elsewhere(model_dir: Path) -> bool:
    """Whether another process holds the build lock now (only to say why this one waits)."""
    import fcntl

    path = lock_path(model_dir)
    if not path.exists():
        return False
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    return False


@contextlib.contextmanager
def _inductor_cache(model_dir: Path) -> Iterator[None]:
    """Inductor's and Triton's caches under the model's folder (a rebuild reuses its kernels);
    a user's own ``TORCHINDUCTOR_CACHE_DIR`` wins."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env is None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(model_dir) / TORCH_CACHE_DIR / "inductor")
    try:
        yield
    finally:
        if env is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def _compile(weights: Path, meta: ModelMeta, key: TorchEngineKey, device: int, out: Path, say: Say,
             what: str, tuning_cache: Path) -> dict[str, Any]:
    """Export and compile into ``out``; check the result. Returns how it was built (for the manifest)."""
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailable("torch is not installed", hint="pip install torch") from exc
    dev = torch.device("cuda", device) if key.gpu_name != "cpu" else torch.device("cpu")
    cuda = dev.type == "cuda"
    with (fresh_process_check(dev.index or 0, key, meta) if cuda else contextlib.nullcontext()) as fresh, \
            cpu_isa_proved_beside(cuda):
        return _export_compile_check(weights, meta, key, dev, out, say, what, tuning_cache, fresh)


def _export_compile_check(weights: Path, meta: ModelMeta, key: TorchEngineKey, dev: Any, out: Path, say: Say,
                          what: str, tuning_cache: Path, fresh: FreshProcess | None) -> dict[str, Any]:
    import torch

    from app.gpu.torch_model import check_head, load_model, torch_dtype

    say(f"{what}: exporting the model with torch.export (1 of 3)")
    model, _ = load_model(weights, precision=key.precision, device=dev, anchors_in_graph=True)
    example = torch.rand((example_batch(key), 3, meta.imgsz, meta.imgsz), generator=torch.Generator().manual_seed(0))
    example = example.to(dev, torch_dtype(key.precision))
    with torch.inference_mode(), exact_fp32(key.precision):
        reference = check_head(model(example), meta, example.shape[0]).float()
    cuda = dev.type == "cuda"
    invariant = key.batch_invariant and cuda
    stem = "space-to-depth" if invariant and rewrite_stem(model, meta.imgsz) else "as trained"
    pools = "separable" if invariant and rewrite_pools(model) else "as trained"
    program = export_program(model, example, key)
    del model
    say(f"{what}: compiling with AOTInductor (2 of 3{'' if key.batch_invariant else '; a minute or two on a first build'})")
    tuning_batch = int(example.shape[0])
    with (tuned(program, dev.index or 0, tuning_cache, say, tuning_batch=tuning_batch) if invariant
          else contextlib.nullcontext({})) as tuning:
        compile_package(program, out, batch_invariant=invariant, cuda=cuda)
    del program
    say(f"{what}: checking it against the eager model (3 of 3)")
    checked = check_package(out, example, reference, key, meta, dev, fresh)
    return {**checked, "inductor": settings_text(invariant, cuda), "stem": stem, "pools": pools,
            **({"tuning": asdict(tuning["report"])} if "report" in tuning else {})}


def example_batch(key: TorchEngineKey) -> int:
    """The batch traced: the fixed one, or for a dynamic range ``TUNING_BATCH`` brought into it
    (at least 2: torch.export specialises sizes 0 and 1, so a batch of 1 would fix the dimension).
    Inductor takes the traced size as its hint for the dimension: every template and pointwise
    kernel is tuned at that batch."""
    if key.min_batch == key.max_batch:
        return key.max_batch
    return min(max(TUNING_BATCH, key.min_batch, 2), key.max_batch)


def export_program(model: Any, example: Any, key: TorchEngineKey) -> Any:
    """``torch.export`` of ``model`` on ``example``, the batch dimension dynamic over the key's range."""
    import torch

    dynamic = None
    if key.min_batch != key.max_batch:
        dynamic = ({0: torch.export.Dim("batch", min=key.min_batch, max=key.max_batch)},)
    try:
        with torch.inference_mode(False), torch.no_grad():
            return torch.export.export(model, (example,), dynamic_shapes=dynamic, strict=False)
    except Exception as exc:  # a model torch.export cannot trace: say which step failed
        raise BackendUnavailable(f"torch.export could not trace the model: {type(exc).__name__}: {exc}"[:500]) from exc


def compile_package(program: Any, out: Path, *, batch_invariant: bool = False, cuda: bool = False) -> Path:
    """AOTInductor: ``program`` → the ``.pt2`` package ``out``, its library linked so that a fresh
    process loads it (``app.builder.aoti_link``); ``batch_invariant`` (CUDA only): every
    convolution and matrix product a Triton template; ``cuda``: a package whose kernels all run on
    the GPU (``app.builder.inductor_settings``)."""
    import torch._inductor

    from app.builder.aoti_link import linking

    with linking(where=out.parent):  # no C++ compiler: its own BackendUnavailable
        try:
            return Path(torch._inductor.aoti_compile_and_package(
                program, package_path=str(out), inductor_configs=inductor_configs(batch_invariant, cuda)))
        except Exception as exc:  # an inductor or compiler failure: one clear line
            raise BackendUnavailable(f"AOTInductor could not compile the model: {type(exc).__name__}: {exc}"[:500],
                                     hint="AOTInductor needs a C++ compiler (g++) beside torch") from exc


@contextlib.contextmanager
def exact_fp32(precision: str) -> Iterator[None]:
    """fp32 means fp32 (no TF32), as the engine runs it (``app.backends.torch_cuda``)."""
    import torch

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = cudnn.allow_tf32, matmul.allow_tf32
    if precision == "fp32":
        cudnn.allow_tf32 = matmul.allow_tf32 = False
    try:
        yield
    finally:
        cudnn.allow_tf32, matmul.allow_tf32 = saved


def check_package(path: Path, example: Any, reference: Any, key: TorchEngineKey, meta: ModelMeta, dev: Any,
                  fresh: FreshProcess | None = None) -> dict[str, Any]:
    """Load the package and run it on the traced batch and on its smallest batch: the head must
    equal the eager model's within ``CHECK_TOLERANCE`` (boxes in pixels, then scores); ``fresh``
    (CUDA): the new process that loads it too (``fresh_process_check``), beside these checks."""
    import torch

    from app.gpu.torch_model import check_head, load_package

    box_tol, score_tol = CHECK_TOLERANCE[key.precision]
    worst = [0.0, 0.0]
    if fresh is not None:
        fresh.load(path)  # the new process loads it while this one checks it
    try:
        runner = load_package(path, dev)  # as a run loads it
    except ArtifactError as exc:
        raise BackendUnavailable(f"the AOTInductor package just built does not load: {exc.message}") from exc
    with torch.inference_mode(), exact_fp32(key.precision):
        for n in sorted({example.shape[0], key.min_batch}):
            got = check_head(runner(example[:n].contiguous()), meta, n).float()
            diff = (got - reference[:n]).abs()
            worst = [max(worst[0], diff[:, :4].max().item()), max(worst[1], diff[:, 4:].max().item())]
        varies = batch_variance(runner, example, key) if key.batch_invariant and dev.type == "cuda" else []
    del runner
    if varies:
        raise BackendUnavailable("the AOTInductor package built with batch-invariant kernels is not batch-"
                                 "invariant on this GPU: an image's head differs " + "; ".join(varies),
                                 hint="--no-batch-invariant runs cuDNN's kernels (answers then vary with the batch)")
    fresh_timings = fresh.answer() if fresh is not None else {}
    if not all(w <= t for w, t in zip(worst, (box_tol, score_tol))):  # NaN fails too
        raise ArtifactError(f"the compiled torch-cuda engine differs from the eager model by {worst[0]:.3g} px "
                            f"(boxes) and {worst[1]:.3g} (scores), over {box_tol} and {score_tol}")
    return {"checked_max_abs_diff": {"boxes_px": worst[0], "scores": worst[1]}, "example_batch": int(example.shape[0]),
            "batch_invariance_checked": key.batch_invariant, "fresh_process": fresh_timings}
