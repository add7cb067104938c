"""Shared test setup: deterministic seeds, the `gpu` marker's auto-skip, per-dtype tolerances, the build of
the CPU emulator of device code (csrc/emu), the CUDA entry points a test needs (`cuda_ext_with`), SASS dumps,
optimizer-state comparisons, the case seeds of the random-configuration (fuzz) tests, and the tiny SDAR model
and rollout batch of test_rl / test_logprobs."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Switches that change which implementation the ops run. A test that wants one sets it itself (monkeypatch);
# inherited from the shell, LRF_DISABLE_KERNELS=1 would make every kernel-vs-reference GPU test compare the
# reference with itself, and the others would move the defaults the tests assume.
KERNEL_SWITCHES = ("LRF_DISABLE_KERNELS", "LRF_DECODE_GEMM", "LRF_BLOCK_ATTN_VARIANT", "LRF_PDL")


def pytest_configure(config):
    dropped = [k for k in KERNEL_SWITCHES if os.environ.pop(k, None) is not None]
    if dropped:
        print(f"conftest: ignoring {', '.join(dropped)} from the environment (tests set the switches they test)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def kernel_switches_kept():
    """Each test ends with the kernel switches as it found them: monkeypatch restores only what a test set
    through it, and the decoder's capture fallback sets LRF_PDL=0 for the process (a GPU test that provoked it
    would otherwise run every later test without PDL)."""
    before = {k: os.environ.get(k) for k in KERNEL_SWITCHES}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def seeds():
    """Every test starts from the same seeds (Python, torch CPU and CUDA)."""
    random.seed(0)
    torch.manual_seed(0)  # seeds CUDA too
    yield


_TOLERANCES = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def tolerance(dtype: torch.dtype) -> dict:
    """`dict(rtol=..., atol=...)` for comparing a kernel in `dtype` against a float64 reference."""
    rtol, atol = _TOLERANCES[dtype]
    return {"rtol": rtol, "atol": atol}


# ------------------------------------------------------------------ the CPU emulator of device code (csrc/emu)

REPO = Path(__file__).resolve().parents[1]  # the source tree (pytest imports the installed package)
EMU_DIR = REPO / "csrc" / "emu"
EMU_FLAGS = ["-std=c++20", "-O2", "-ffp-contract=off", "-Wno-unknown-pragmas", "-DLRF_KERNEL_EMULATION"]
# Order-seed bit of the cuda_builtins drivers (unmask, rms_norm, silu_mul, grpo_loss): the warp-greedy schedule
# (emu_core.h Launch::warp_greedy; the warp_ops drivers take it for odd seeds)
EMU_GREEDY = 1 << 63


def cuda_include() -> Path | None:
    """The CUDA headers' folder (cuda_fp16.h), or None."""
    from torch.utils.cpp_extension import CUDA_HOME

    for root in (os.environ.get("CUDA_HOME"), CUDA_HOME, "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_fp16.h").is_file():
            return Path(root) / "include"
    return None


def cutlass_include() -> Path | None:
    """CUTLASS/CuTe's include folder from the nvidia-cutlass wheel (the build's headers, setup.py), or None."""
    import importlib.util

    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    inc = Path(next(iter(spec.submodule_search_locations))) / "source" / "include"
    return inc if (inc / "cute" / "tensor.hpp").is_file() else None


def skip_or_fail(reason: str):
    """Skip, or fail under LRF_EXPECT_CUDA_BUILD=1 (CI, which installs the CUDA toolkit and the CUTLASS headers)."""
    if os.environ.get("LRF_EXPECT_CUDA_BUILD") == "1":
        pytest.fail(f"LRF_EXPECT_CUDA_BUILD=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def emu_build(tmp_path_factory):
    """`build(driver, shared=False, cuda_headers=False, cutlass=False)` -> the path of csrc/emu/<driver> compiled
    with the host compiler ($CXX or g++): an executable, or with `shared` a library for ctypes. Cached under
    build/emu/ per version of csrc/emu and csrc/kernels, compiler and flags. Skips without a compiler, without the
    CUDA headers when `cuda_headers` (the CUDA-builtins front-end includes cuda_fp16.h), or without _Float16.
    `cutlass` adds CUTLASS/CuTe and the CUDA toolkit's cccl headers (skipped without them, failed in CI)."""

    def build(driver: str, shared: bool = False, cuda_headers: bool = False, cutlass: bool = False) -> Path:
        src = EMU_DIR / driver
        cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
        if not src.is_file() or cxx is None:
            pytest.skip("the emulator needs the csrc/ sources and a C++20 host compiler (g++ or $CXX)")
        cmd = [cxx, *EMU_FLAGS, f"-I{REPO / 'csrc'}"]
        if cuda_headers:
            inc = cuda_include()
            if inc is None:
                pytest.skip("the CUDA-builtins emulator needs the CUDA headers (cuda_fp16.h)")
            cmd.append(f"-I{inc}")
        if cutlass:
            inc, cute = cuda_include(), cutlass_include()
            if inc is None or cute is None or not (inc / "cccl" / "cuda" / "std").is_dir():
                skip_or_fail("the GMMA layout check needs the CUTLASS headers (nvidia-cutlass) and CUDA's cccl headers")
            cmd += [f"-I{cute}", f"-I{inc}", f"-I{inc / 'cccl'}", "-w"]
        if shared:
            cmd += ["-shared", "-fPIC"]
        sources = sorted([*EMU_DIR.iterdir(), *(REPO / "csrc" / "kernels").iterdir()])
        digest = hashlib.sha256(" ".join([*cmd, driver]).encode())
        for f in sources:
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
        out_dir = REPO / "build" / "emu"
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            out_dir = tmp_path_factory.mktemp("emu")
        out = out_dir / f"{src.stem}-{digest.hexdigest()[:16]}{'.so' if shared else ''}"
        if not out.exists():
            tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
            res = subprocess.run([*cmd, str(src), "-o", str(tmp)], capture_output=True, text=True)
            if res.returncode != 0 and "_Float16" in res.stderr:
                pytest.skip("the host compiler lacks _Float16")
            assert res.returncode == 0, f"emulator build failed:\n{' '.join(cmd)}\n{res.stderr[-4000:]}"
            os.replace(tmp, out)
        return out

    return build


# ------------------------------------------------------- random configurations of the emulated kernels (fuzzing)

def fuzz_cases(default: int = 3) -> list:
    """Parameters for a test that draws a random kernel configuration from its case seed: LRF_FUZZ_CASES cases
    (default `default`: what CI runs, the same every run), numbered from LRF_FUZZ_SEED * 1_000_000 (default 0).
    A campaign raises both (`LRF_FUZZ_CASES=2000 LRF_FUZZ_SEED=7 pytest -k random_config ...`); a failing case is
    re-run alone by its id (`fuzz<seed>`), which names its seed, with the same two variables."""
    values = {}
    for name, fallback in (("LRF_FUZZ_CASES", default), ("LRF_FUZZ_SEED", 0)):
        raw = os.environ.get(name, "")
        try:
            values[name] = int(raw) if raw.strip() else fallback
        except ValueError:
            raise pytest.UsageError(f"{name} must be a non-negative integer, got {raw!r}") from None
        if values[name] < 0:
            raise pytest.UsageError(f"{name} must be a non-negative integer, got {raw!r}")
    first = values["LRF_FUZZ_SEED"] * 1_000_000
    return [pytest.param(first + i, id=f"fuzz{first + i}") for i in range(values["LRF_FUZZ_CASES"])]


def same_layout_on(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device` with its shape, strides and storage offset kept: its whole storage copied there and the view
    rebuilt (`t.to(device)` makes a non-dense view contiguous), so a kernel on the GPU sees the layout a random
    configuration drew on the CPU (padded rows, offsets, stride-0 dims; the 16-byte alignment of the offset too, a
    storage being at least 64-byte aligned on either device). `t` itself where it already is. Views of one storage
    moved separately become separate copies."""
    device = torch.device(device)
    if t.device.type == device.type and device.index in (None, t.device.index):
        return t
    base = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
    return base.to(device).as_strided(t.shape, t.stride(), t.storage_offset())


@contextlib.contextmanager
def poisoned_cuda_outputs(*nbytes: int):
    """Within the block, CUDA tensors of these byte sizes allocated in this order (the outputs a launcher allocates
    with at::empty, and nothing else) start as 0xFF bytes, NaN in every float dtype: the GPU counterpart of the
    emulator tests' NaN-filled outputs, so an element the kernel does not write shows. The block allocates from a
    fresh private memory pool in which tensors of the same sizes were filled and freed first: the freed blocks
    merge back into the pool's fresh segments, and the same requests in the same order carve the same addresses.
    Take the outputs off the device (.cpu()) inside the block: the pool goes when it ends (a pool should outlive
    its tensors). Best effort: without torch.cuda.MemPool nothing is poisoned."""
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda, "use_mem_pool"):
        yield
        return
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        poison = [torch.full((n,), 255, dtype=torch.uint8, device="cuda") for n in nbytes if n > 0]
        del poison
        yield


@pytest.fixture
def cuda_ext_with():
    """`cuda_ext_with(*names)` -> lightningrl_fast._C when it is built with CUDA and has every entry point in
    `names`. Otherwise the test is skipped, or failed under LRF_EXPECT_CUDA_BUILD=1 (CI's CUDA build), where a
    lost kernel must not pass as a skip; a GPU test that ran the reference instead would compare it with itself."""
    from lightningrl_fast import _ext

    def need(*names: str):
        mod = _ext.ext()
        missing = [n for n in names if mod is None or not hasattr(mod, n)]
        if not _ext.has_cuda_kernels() or missing:
            skip_or_fail(f"lightningrl_fast._C has no {', '.join(missing) or 'CUDA kernels'}")
        return mod

    return need


@pytest.fixture
def one_thread():
    """torch on one CPU thread for the test (tiny models decode faster than with thread hand-offs), restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def ascii_checkpoint():
    """`ascii_checkpoint(folder, max_pos=512)` -> folder: a tiny random SDAR checkpoint (float32, block 4) whose
    char tokenizer encodes every printable ASCII character, so the math / code tasks' prompt templates encode:
    the `--model DIR` path of the CLIs without a real tokenizer."""
    import string

    from lightningrl_fast.checkpoint import save_model
    from lightningrl_fast.model import SDARConfig, build_model
    from lightningrl_fast.tokenizer import CharTokenizer

    def make(folder: Path, max_pos: int = 512) -> Path:
        tok = CharTokenizer("".join(c for c in string.printable if c not in "\r\x0b\x0c\t"))
        cfg = SDARConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, block_size=4,
                         mask_token_id=tok.mask_token_id, torch_dtype="float32", max_position_embeddings=max_pos)
        save_model(build_model(cfg, dtype=torch.float32, seed=0), cfg, folder, tokenizer=tok)
        return folder

    return make


def find_cuobjdump() -> str | None:
    """cuobjdump from the CUDA toolkit, else the one the triton package ships (as .ci/run finds it)."""
    import importlib.util
    import shutil

    from torch.utils.cpp_extension import CUDA_HOME

    for root in (os.environ.get("CUDA_HOME"), CUDA_HOME, "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "cuobjdump").is_file():
            return str(Path(root) / "bin" / "cuobjdump")
    if shutil.which("cuobjdump"):
        return shutil.which("cuobjdump")
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.submodule_search_locations:
        exe = Path(next(iter(spec.submodule_search_locations))) / "backends" / "nvidia" / "bin" / "cuobjdump"
        if exe.is_file():
            return str(exe)
    return None


def sass_functions(cuobjdump: str, library: str) -> dict[str, str]:
    """{mangled kernel name: its SASS text} of every function in `library` (cuobjdump --dump-sass)."""
    sass = subprocess.run([cuobjdump, "--dump-sass", library], capture_output=True, text=True, timeout=600).stdout
    funcs: dict[str, str] = {}
    name = None
    for line in sass.splitlines():
        if "Function :" in line:
            name = line.split("Function :", 1)[1].strip()
            funcs[name] = ""
        elif name is not None:
            funcs[name] += line + "\n"
    return funcs


def opt_by_index(state) -> dict[int, dict]:
    """The optimizer state of the parameters a TrainState's optimizer holds (this rank's), keyed by their index in
    model.parameters(); tensors copied to the CPU."""
    out = {}
    for i, p in enumerate(state.model.parameters()):
        if p in state.optimizer.state:
            out[i] = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                      for k, v in state.optimizer.state[p].items()}
    return out


def assert_same_opt(a: dict, b: dict) -> None:
    """Two `opt_by_index` results hold the same parameters, keys and values exactly."""
    assert sorted(a) == sorted(b)
    for i in a:
        assert a[i].keys() == b[i].keys(), i
        for k in a[i]:
            assert torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(b[i][k])), (i, k)


# ------------------------------------------------------------ the tiny SDAR model of test_rl and test_logprobs

TINY_MASK, TINY_VOCAB = 110, 111  # mask token id, vocabulary (odd on purpose)


def tiny_rl_model(seed=0, dtype=torch.float64, peaky=60.0):
    """A 2-layer SDAR model (block 4, GQA 4/2, vocabulary 111) whose LM head is scaled by `peaky`, so that several
    tokens pass the threshold per step when it decodes."""
    from lightningrl_fast.model import SDARConfig, build_model

    cfg = SDARConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=4,
                     mask_token_id=TINY_MASK, torch_dtype="float32", max_position_embeddings=256)
    m = build_model(cfg, dtype=dtype, seed=seed).eval()
    m.lm_head.weight.data *= peaky
    return m


def varied_layout_batch(model, mode, seed=5):
    """A LayoutBatch of 12 rows of very different lengths (prompts 1..30 tokens, EOS early or never) and rounds,
    decoded by `model` (a tiny_rl_model)."""
    from lightningrl_fast.rl.logprobs import build_layout_batch
    from lightningrl_fast.sampler import SamplerConfig, generate

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 100, (n,), generator=g).tolist() for n in [1, 30, 4, 17, 9, 2]]
    ro = generate(model, [p for p in prompts for _ in range(2)],
                  SamplerConfig(threshold=0.3, temperature=1.0, max_new_tokens=23, eos_ids=(3, 7, 11), seed=seed))
    return build_layout_batch(ro.sequences, ro.seq_step_map, ro.prompt_lens, ro.lengths, 4, TINY_MASK, mode)


class StandInStreams:
    """CUDA streams and events stood in for on the CPU, for the ordering tests of the code that overlaps copies with
    compute (rl/optim._Staging, rl/logprobs._LayerFeed): `install(monkeypatch, module)` replaces the module's
    torch.cuda.current_stream and torch.cuda.stream; `side()` makes a side stream. Every call appends to `log`:
    ("side waits current",), ("side waits", ev), ("side records", ev), ("current waits", ev), ("current records",
    ev), ("join", side), ("enter", stream), ("exit", stream); events are fresh objects."""

    def __init__(self) -> None:
        self.log: list = []
        self.sides: list = []
        streams = self

        class Side:
            def wait_stream(self, _s):
                streams.log.append(("side waits current",))

            def wait_event(self, ev):
                streams.log.append(("side waits", ev))

            def record_event(self):
                streams.log.append(("side records", object()))
                return streams.log[-1][1]

        class Current:
            def wait_event(self, ev):
                streams.log.append(("current waits", ev))

            def record_event(self):
                streams.log.append(("current records", object()))
                return streams.log[-1][1]

            def wait_stream(self, s):
                streams.log.append(("join", s))

        self._side_type, self.current = Side, Current()

    def side(self):
        s = self._side_type()
        self.sides.append(s)
        return s

    def install(self, monkeypatch, module) -> None:
        @contextlib.contextmanager
        def on(stream):
            self.log.append(("enter", stream))
            yield
            self.log.append(("exit", stream))

        monkeypatch.setattr(module.torch.cuda, "current_stream", lambda dev=None: self.current)
        monkeypatch.setattr(module.torch.cuda, "stream", on)

