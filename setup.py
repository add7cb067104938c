"""Builds lightningrl_fast._C with torch.utils.cpp_extension (project metadata lives in pyproject.toml).

Build against the torch that is installed: `pip install --no-build-isolation .` (README, Development).
The sources are listed once in csrc/sources.txt (CMakeLists.txt reads the same file).

Environment switches:
  LRF_CUDA_ARCHS     ';'-separated CUDA archs, default "90a" -> -gencode=arch=compute_90a,code=sm_90a;
                     "90a;100a" builds both; a "+PTX" suffix ("90a+PTX") also embeds PTX for that arch.
  LRF_SKIP_CUDA=1    CPU-only build even when nvcc is found.
  LRF_PTXAS_VERBOSE=1  pass -Xptxas=-v (register / spill report per kernel).
  MAX_JOBS           parallel compile jobs, default 2 (kept when set).
  NVCC_THREADS       nvcc --threads, default 2 (kept when set).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
EXT_NAME = "lightningrl_fast._C"


# pip runs setup.py once for metadata (egg_info / dist_info) and once to build: speak only when building
METADATA_ONLY = any(cmd in sys.argv for cmd in ("egg_info", "dist_info", "sdist"))


def log(msg: str) -> None:
    if not METADATA_ONLY:
        print(f"lightningrl_fast build: {msg}", file=sys.stderr, flush=True)


def read_sources() -> list[str]:
    """csrc/sources.txt: one path per line relative to csrc/, '#' comments."""
    sources = []
    for line in (CSRC / "sources.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            sources.append(f"csrc/{line}")
    return sources


def cuda_archs() -> list[str]:
    archs = [a.strip() for a in os.environ.get("LRF_CUDA_ARCHS", "90a").split(";") if a.strip()]
    for a in archs:
        if not re.fullmatch(r"\d{2,3}[af]?(\+PTX)?", a):
            raise SystemExit(f"LRF_CUDA_ARCHS: bad arch {a!r} (expected e.g. '90a', '100a', '90a+PTX')")
    if not archs:
        raise SystemExit("LRF_CUDA_ARCHS is empty; unset it for the default '90a'")
    return archs


def gencode_flags(archs: list[str]) -> list[str]:
    flags = []
    for a in archs:
        base = a.removesuffix("+PTX")
        flags.append(f"-gencode=arch=compute_{base},code=sm_{base}")
        if a.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{base},code=compute_{base}")
    return flags


def cutlass_include_dirs() -> list[str]:
    """CUTLASS/CuTe headers from the nvidia-cutlass wheel (cutlass_library/source/...), when installed."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        src = Path(next(iter(spec.submodule_search_locations))) / "source"
        dirs = [src / "include", src / "tools" / "util" / "include"]
        if all((d / "cutlass").is_dir() for d in dirs):
            return [str(d) for d in dirs]
    log("WARNING: CUTLASS/CuTe headers not found (pip install --no-deps nvidia-cutlass==4.2.0.0); "
        "building without them (no kernel needs them yet)")
    return []


def is_toolkit(root: str | Path | None) -> bool:
    return root is not None and (Path(root) / "bin" / "nvcc").exists() and (Path(root) / "include" / "cuda_runtime.h").exists()


def guess_cuda_home() -> None:
    """Without CUDA_HOME/CUDA_PATH torch guesses the toolkit from `which nvcc`, which a wrapper script in
    /usr/local/bin turns into /usr/local (no CUDA headers): pick a real toolkit before torch looks."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    for root in ([Path(nvcc).resolve().parents[1]] if nvcc else []) + [Path("/usr/local/cuda")]:
        if is_toolkit(root):
            os.environ["CUDA_HOME"] = str(root)
            return


def cuda_build_reason(torch) -> str | None:
    """None when the CUDA build is possible, else why not."""
    if os.environ.get("LRF_SKIP_CUDA", "0") not in ("", "0"):
        return "LRF_SKIP_CUDA is set"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    guess_cuda_home()
    from torch.utils.cpp_extension import CUDA_HOME

    if not is_toolkit(CUDA_HOME):
        return f"no CUDA toolkit (nvcc + headers) at CUDA_HOME={CUDA_HOME}; set CUDA_HOME"
    return None


def extensions() -> tuple[list, dict]:
    try:
        import torch
    except ImportError:
        if METADATA_ONLY:
            return [], {}  # metadata and sdist need no compiler
        raise SystemExit(
            "lightningrl_fast: torch is not importable in this build environment. Install torch first and "
            "build against it with `pip install --no-build-isolation .` (README, Development)."
        )

    os.environ.setdefault("MAX_JOBS", "2")
    why_not = cuda_build_reason(torch)  # before importing cpp_extension, which fixes CUDA_HOME on import
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    sources = read_sources()
    include_dirs = [str(CSRC)] + cutlass_include_dirs()
    cxx_flags = ["-O3"]
    if why_not is not None:
        log(f"CPU-ONLY BUILD ({why_not}): _C has no CUDA kernels; ops on CUDA tensors use the PyTorch reference")
        ext = CppExtension(
            EXT_NAME,
            [s for s in sources if not s.endswith(".cu")],
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
        )
    else:
        archs = cuda_archs()
        nvcc_flags = ["-O3", "-lineinfo", "--expt-relaxed-constexpr",
                      "--threads", os.environ.get("NVCC_THREADS", "2"), *gencode_flags(archs)]
        if os.environ.get("LRF_PTXAS_VERBOSE", "0") not in ("", "0"):
            nvcc_flags.append("-Xptxas=-v")
        log(f"CUDA build for sm_{', sm_'.join(a.removesuffix('+PTX') for a in archs)} (torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, CUDA_HOME={CUDA_HOME}, MAX_JOBS={os.environ['MAX_JOBS']})")
        ext = CUDAExtension(
            EXT_NAME,
            sources,
            include_dirs=include_dirs,
            define_macros=[("LRF_WITH_CUDA", "1"), ("LRF_CUDA_ARCHS", ",".join(a.removesuffix("+PTX") for a in archs))],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
