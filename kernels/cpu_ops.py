"""The C++ CPU kernels (kernels/cpu/*.cpp), compiled on first use on the machine that runs them.

    ops = load(extensions_dir)   # the extension module, or None: callers keep their torch path

load() JIT-compiles the sources with torch.utils.cpp_extension (-O3 -march=native, OpenMP
through at::parallel_for, so torch's thread count applies) into `extensions_dir` (the worker
passes <mesh cache>/torch_extensions; $TORCH_EXTENSIONS_DIR wins), in a folder named after a
hash of the sources, the flags, torch's version and this CPU's features: a change to any of
them builds anew, and a cache shared between different machines never hands one another's
binary. Where the kernels cannot be built (no compiler, no ninja) it logs one warning and
returns None; LLM_MESH_CPU_KERNELS=0 turns them off on purpose (the torch path then runs
everywhere).

The ops (see kernels/cpu/bindings.cpp): attention_plan, paged_attention, reshape_and_cache,
rms_norm, add_rms_norm, silu_and_mul, rotary_embedding, quant_linear, amx_linear (with
amx_pack_bf16 and amx_linear_supported), quantize_per_token,
dequantize_int32; `vec_size` is the kernels' vector width in floats.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import structlog
import torch

log = structlog.get_logger(__name__)

ENV_CPU_KERNELS = "LLM_MESH_CPU_KERNELS"  # "0": never build or use the C++ kernels
NAME = "llm_mesh_cpu_ops"
SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
SOURCES = ("bindings.cpp", "attention_plan.cpp", "attention.cpp", "attention_decode.cpp",
           "attention_prefill_bf16.cpp",
           "kv_cache.cpp", "layer_ops.cpp", "quant_linear.cpp", "quant_int8.cpp",
           "amx_linear.cpp")
# NOTE: -ffp-contract=off keeps a * b + c as two roundings, as torch's elementwise ops round
# (GCC would fuse them into FMAs by default); the kernels ask for FMAs where they want them.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
# NOTE: linking libgomp by soname makes the loader reuse the libgomp.so.1 torch already loaded:
# one OpenMP runtime, one thread pool, and torch.set_num_threads governs the kernels too.
LDFLAGS = ("-fopenmp",)
ESTIMATED_COMPILE_S = 30


_failure: str | None = None  # why the last build failed


def is_enabled() -> bool:
    return os.environ.get(ENV_CPU_KERNELS, "1") != "0"


def load(extensions_dir: Path) -> ModuleType | None:
    """The compiled kernels, or None (disabled, or they could not be built: one warning).
    NOTE: the caller names the build folder, so kernels/ depends on no service's config."""
    return _load(extensions_dir) if is_enabled() else None


def unavailable_reason(extensions_dir: Path) -> str | None:
    """Why load() returns None (None when it returns the kernels)."""
    if not is_enabled():
        return f"{ENV_CPU_KERNELS}=0"
    return None if _load(extensions_dir) is not None else f"the build failed: {_failure}"


@functools.cache
def _load(extensions_dir: Path) -> ModuleType | None:
    build_dir = _build_dir(extensions_dir)
    built = sorted(build_dir.glob(f"{NAME}*.so"))
    if built:
        try:
            return _import_built(built[0])
        except ImportError as e:   # half-written by a build in progress: wait for it below
            log.info("CPU kernels not importable yet; building", error=str(e)[-200:])
    log.info(f"compiling CPU kernels (one-time, ~{ESTIMATED_COMPILE_S} s)",
             build_dir=str(build_dir))
    started = time.perf_counter()
    try:
        _ensure_ninja_on_path()
        from torch.utils import cpp_extension

        build_dir.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name=NAME, sources=[str(SOURCE_DIR / s) for s in SOURCES],
            extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir), verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch path
        global _failure
        _failure = f"{type(e).__name__}: {str(e)[-500:]}"
        log.warning("CPU kernels unavailable, using the torch path (slower)",
                    error=f"{type(e).__name__}: {str(e)[-2000:]}")
        return None
    log.info("compiled CPU kernels", seconds=round(time.perf_counter() - started, 1),
             vec_size=module.vec_size)
    return module


def _import_built(path: Path) -> ModuleType:
    """The kernels built before, imported as they are.
    NOTE: not through cpp_extension.load, which runs ninja, and ninja rebuilds (~45 s) when
    the sources' paths or mtimes differ from the last build's: after a git checkout or pull,
    or with a second checkout sharing the cache, though the folder's name already pins the
    sources' contents, the flags, torch and the CPU."""
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build_dir(extensions_dir: Path) -> Path:
    digest = hashlib.sha256()
    for name in sorted(p.name for p in SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(name.encode() + (SOURCE_DIR / name).read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(f"{torch.__version__} {sys.version_info[:2]} {_cpu_features()}".encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or extensions_dir
    return Path(root) / f"{NAME}-{digest.hexdigest()[:16]}"


def _cpu_features() -> str:
    """The CPU's feature flags: what -march=native compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _ensure_ninja_on_path() -> None:
    """torch's JIT builds need ninja: the pip wheel's binary sits beside our interpreter, which
    is not on PATH when the venv's python is run without activating the venv."""
    if shutil.which("ninja"):
        return
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = os.pathsep.join((bin_dir, os.environ.get("PATH", "")))


if __name__ == "__main__":
    # `python -m kernels.cpu_ops DIR`: builds the kernels now (e.g. at setup), not at first use.
    if len(sys.argv) != 2:
        sys.exit("usage: python -m kernels.cpu_ops EXTENSIONS_DIR")
    extensions_dir = Path(sys.argv[1])
    started = time.perf_counter()
    module = load(extensions_dir)
    print(f"CPU kernels: {'ready' if module else unavailable_reason(extensions_dir)} "
          f"({time.perf_counter() - started:.1f} s, build dir {_build_dir(extensions_dir)})")
    sys.exit(0 if module else 1)
