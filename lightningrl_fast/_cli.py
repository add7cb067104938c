"""The command-line plumbing `generate` and `eval` share: `CLIError` (one `error:` line, exit status 2) and
`cli_main`; the checks that run before anything heavy loads (decoding flags through the sampler's own checks,
the model folder, a training run's folder standing for its latest checkpoint, the block size against the model's
positions, the device); the loaders that turn their errors into CLIError; the decoding options and their
SamplerConfig; `decode_texts` (one Decoder call plus the response texts) and a progress bar.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch


DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}


class CLIError(Exception):
    """A user error the command line reports as `error: ...` (exit status 2), without a traceback."""


def split_lines(text: str) -> list[str]:
    """The lines of a JSONL / .txt file: split at "\n", "\r\n" and "\r" (universal newlines), not at the other
    separators `str.splitlines` knows (U+2028, U+0085, form feed, ...), which may sit inside a JSON string or a
    prompt."""
    lines = re.split(r"\r\n|\r|\n", text)
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_line(line: str) -> Any:
    """One JSON value of a JSONL line; ValueError with a readable reason (strict JSON: NaN / Infinity, which
    Python would read and then write back as invalid JSON, are refused, as are values Python cannot hold)."""
    try:
        return json.loads(line, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"{e.msg} at column {e.colno}") from None
    except (ValueError, RecursionError) as e:  # NaN / Infinity, > 4300-digit integers, nesting too deep
        raise ValueError(str(e)) from None


def check_block_size(block_size: int | None, max_len: int) -> None:
    """A --block-size larger than the model's positions would decode past them (and allocate a cache that wide)."""
    if block_size is not None and block_size > max_len:
        raise CLIError(f"--block-size {block_size} exceeds the model's max_position_embeddings {max_len}")


def check_checkpoint_block_size(block_size: int | None, model_block_size: int, max_len: int,
                                model_dir: Path) -> None:
    """Without --block-size the checkpoint's config block_size is used: one larger than its positions cannot
    decode a single block (every prompt would fail at the sampler, after the model loaded)."""
    if block_size is None and model_block_size > max_len:
        raise CLIError(f"{model_dir / 'config.json'}: block_size {model_block_size} exceeds max_position_embeddings "
                       f"{max_len}, so no block fits; give a --block-size of at most {max_len}")


RUN_CONFIG_KEYS = ("run", "data", "rl", "sampler", "checkpoint")  # sections of a training run's config.json


def _is_run_config(path: Path) -> bool:
    """Whether `path` (a config.json) is a training run's config (its sections, no model keys)."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False  # not one: reading it as a model config names the problem
    return isinstance(obj, dict) and "vocab_size" not in obj and any(k in obj for k in RUN_CONFIG_KEYS)


@contextlib.contextmanager
def plain_warnings() -> Iterator[None]:
    """A command line's warnings as one `warning: <text>` line each on stderr, each text once (the library's
    warnings.warn calls showed a source line under each, and the same text from two call sites twice). Only the
    format and a "once" filter at the end of the list change: -W / PYTHONWARNINGS filters come first and still
    decide (error, ignore), and a caller recording warnings (catch_warnings(record=True)) still gets them."""
    import warnings

    def plain(message, category, filename, lineno, line=None):
        return f"warning: {message}\n"

    fmt = warnings.formatwarning
    with warnings.catch_warnings():
        warnings.filterwarnings("once", append=True)  # after every other filter: each text once
        warnings.formatwarning = plain
        try:
            yield
        finally:
            warnings.formatwarning = fmt


@contextlib.contextmanager
def finish_before_interrupt(what: str) -> Iterator[None]:
    """Ctrl-C while `what` is being written: the write finishes first and KeyboardInterrupt is raised after it (a
    second Ctrl-C stops at once; the unfinished write is a temporary folder the next save clears). Was: the
    interrupt landed inside torch.save, which turned it into a RuntimeError traceback. Only where SIGINT has
    Python's default handler, in the main thread; elsewhere a pass-through. Under torchrun the agent forwards the
    interrupt to every rank and kills them some seconds later (its shutdown timeout, 30 s by default): a longer
    write is cut there, and the checkpoint before it stays the latest."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or (
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield  # SIGINT ignored (a background job) or handled by the caller: left as it is
        return
    pending: list[int] = []

    def handler(signum, frame):
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)
        print(f"interrupt: finishing {what} first (Ctrl-C again to stop now)", file=sys.stderr, flush=True)

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if pending:
        raise KeyboardInterrupt


def interrupted(ex: BaseException) -> bool:
    """Whether `ex` is, or was raised while handling, a KeyboardInterrupt (a library that turns the interrupt into
    its own error, as torch.save's writer does)."""
    seen = set()
    while ex is not None and id(ex) not in seen:
        if isinstance(ex, KeyboardInterrupt):
            return True
        seen.add(id(ex))
        ex = ex.__cause__ or ex.__context__
    return False


def is_run_folder(p: Path) -> bool:
    """A training run's output folder: its config.json is a run's, or it has no config.json and a `latest` file
    or checkpoint-<step> folders."""
    from .rl.checkpointing import LATEST, list_checkpoints

    cfg = p / "config.json"
    if cfg.is_file():  # a model's own config.json beside a `latest` (a DeepSpeed checkpoint-N folder): a model
        return _is_run_config(cfg)
    return (p / LATEST).is_file() or (not cfg.exists() and bool(list_checkpoints(p)))


def run_folder_checkpoint(p: Path, given: str | Path) -> Path:
    """The checkpoint a run folder stands for (`rl.checkpointing.resolve_checkpoint`: the one `latest` names,
    else the highest complete checkpoint-<step>; a --baseline rft run's `rft-model`), or CLIError saying the folder
    is a run's and naming its newest complete checkpoint when there is one."""
    from .rl.checkpointing import LATEST, PREFIX, list_checkpoints, resolve_checkpoint

    try:
        return resolve_checkpoint(p)
    except (OSError, ValueError) as e:
        rft = p / "rft-model"  # a --baseline rft run saves its one model there (no checkpoint-<step>)
        if not (p / LATEST).is_file() and (rft / "config.json").is_file():
            return rft
        ckpts = list_checkpoints(p)
        newest = f"; its newest complete checkpoint is {ckpts[-1]}: give --model {ckpts[-1]}" if ckpts else ""
        if (p / LATEST).is_file() or ckpts:
            raise CLIError(f"--model {given}: a run folder whose latest checkpoint cannot be found ({e}){newest}"
                           ) from None
        raise CLIError(f"--model {given} is a training run folder with no checkpoint yet (no {LATEST} file, no "
                       f"complete {PREFIX}<step> folder); give an SDAR checkpoint folder") from None


def check_model_dir(path: str | Path) -> Path:
    """The checkpoint folder, or CLIError (missing folder / config.json), before anything heavy is loaded. A
    training run's output folder (`is_run_folder`) stands for its latest checkpoint (`run_folder_checkpoint`)."""
    p = Path(path)
    if not p.exists():
        raise CLIError(f"model folder {p} does not exist")
    if not p.is_dir():
        raise CLIError(f"--model {p} is not a folder (expected an SDAR checkpoint folder with config.json)")
    if is_run_folder(p):  # its config.json is the run's: its latest checkpoint
        p = run_folder_checkpoint(p, path)
    if not (p / "config.json").is_file():
        raise CLIError(f"model folder {p} has no config.json")
    return p


def join_ranks(device_name: str):
    """(env, device) of this process for a CLI: under torchrun its rank joined to the process group (one GPU per
    rank), else the single process on `--device`. Leave the group with `distributed.joined(env)`."""
    from .rl import distributed

    try:
        device = distributed.resolve_device(device_name)  # cpu / cuda only, present on this machine
        return distributed.init(distributed.env_from_environment(), device)
    except ValueError as e:
        raise CLIError(str(e)) from None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise CLIError(f"--dtype {name!r} is not one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def eos_ids_for(tokenizer, vocab_size: int) -> tuple[int, ...]:
    """The tokenizer's EOS ids inside the model vocabulary (the sampler stops on any of them)."""
    ids = tuple(sorted(i for i in getattr(tokenizer, "eos_token_ids", ()) if 0 <= i < vocab_size))
    if not ids:
        raise CLIError("the tokenizer declares no EOS token inside the model's vocabulary; cannot stop decoding")
    return ids


@contextlib.contextmanager
def decode_block_size(model, block_size: int | None) -> Iterator[None]:
    """Temporarily run the model's attention with `block_size` (the sampler's blocks and the mask must agree)."""
    old = model.config.block_size
    if block_size is None or block_size == old:
        yield
        return
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    model.config.block_size = block_size
    try:
        yield
    finally:
        model.config.block_size = old


def warn_mask_mismatch(tokenizer, mcfg) -> None:
    """Warn (stderr) when the tokenizer's mask token is not the checkpoint config's mask_token_id: the model's is
    used (train prints the same warning)."""
    tok_mask = getattr(tokenizer, "mask_token_id", None)
    if tok_mask is not None and tok_mask != mcfg.mask_token_id:
        print(f"warning: tokenizer mask id {tok_mask} != model config mask_token_id {mcfg.mask_token_id}; the "
              "model's is used", file=sys.stderr, flush=True)


def decode_texts(model, tokenizer, prompt_ids: list[list[int]], cfg, decoder=None) -> tuple[Any, list[str]]:
    """(Rollout, response texts): one generate call (on `decoder`, a `sampler.Decoder` of `model` kept by a
    loop over batches, else a throwaway one); texts are decoded without the final EOS."""
    from .sampler import Decoder

    decoder = decoder if decoder is not None else Decoder(model)
    ro = decoder.generate(prompt_ids, cfg, pad_id=getattr(tokenizer, "pad_token_id", None))
    texts = []
    for i in range(len(ro)):
        ids = ro.response_ids(i)
        if ro.eos_found[i] and ids:
            ids = ids[:-1]
        texts.append(tokenizer.decode(ids))
    return ro, texts


def progress(total: int, desc: str, enabled: bool = True):
    """A tqdm bar on stderr when tqdm is installed, else a minimal stand-in printing `desc i/total`."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _PlainProgress(total, desc, enabled)
    return tqdm(total=total, desc=desc, unit="batch", disable=not enabled, file=sys.stderr, leave=False)


class _PlainProgress:
    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.enabled, self.n = total, desc, enabled, 0

    def update(self, k: int = 1) -> None:
        self.n += k
        if self.enabled:
            print(f"{self.desc} {self.n}/{self.total}", file=sys.stderr, flush=True)

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def batches(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def sampler_config_from_args(args, eos_ids: tuple[int, ...]):
    from .sampler import SamplerConfig

    return SamplerConfig(block_size=args.block_size, threshold=args.threshold, rule=args.rule,
                         steps_per_block=args.steps_per_block, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, noise=args.noise, max_new_tokens=args.max_new_tokens, eos_ids=eos_ids,
                         cuda_graphs=not args.no_cuda_graphs, seed=args.seed, pack=args.pack)


def add_decoding_args(ap: argparse.ArgumentParser, temperature: float = 0.0, max_new_tokens: int | None = 256,
                      batch_size: int = 16, max_new_tokens_help: str | None = None) -> None:
    """Sampler / device options shared by the generate and eval command lines."""
    g = ap.add_argument_group("decoding")
    g.add_argument("--block-size", type=int, default=None, help="block size (default: the checkpoint's)")
    g.add_argument("--threshold", type=float, default=0.9,
                   help="confidence threshold tau (default 0.9); above 1 no confidence reaches it: top-1 alone, or "
                        "the quota alone with --rule quota")
    g.add_argument("--rule", choices=("threshold", "quota"), default="threshold",
                   help="threshold = top-1 + threshold (LightningRL); quota = SDAR's per-step quota")
    g.add_argument("--steps-per-block", type=int, default=None, help="S for --rule quota (default: block size)")
    g.add_argument("--temperature", type=float, default=temperature, help=f"0 = greedy (default {temperature})")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--noise", choices=("two_level", "per_token"), default="two_level",
                   help="sampling noise: two_level (default; one pass over the logits) or per_token; both exact")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=max_new_tokens_help or f"response length cap (default {max_new_tokens})")
    g.add_argument("--batch-size", type=int, default=batch_size, help="prompts per sampler call")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1, ...")
    g.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run the denoising step eagerly on CUDA")
    g.add_argument("--pack", choices=("auto", "on", "off"), default="auto",
                   help="run each decoding forward's GEMMs on the rows' real chunk tokens only: auto (default; CUDA, "
                        "batches of >= 256 rows x block tokens), on, off")


SEED_LIMIT = 2**62  # Philox seeds are int64; each batch adds its index


STEPS_LIMIT = 2**31 - 1  # the sampler counts a block's steps in int32


SAMPLING_FLAGS = {"threshold": "--threshold", "temperature": "--temperature", "top_k": "--top-k",
                  "top_p": "--top-p", "noise": "--noise"}


def check_decoding_args(args) -> None:
    if not (math.isfinite(args.threshold) and args.threshold >= 0):  # above 1: no confidence reaches it
        raise CLIError(f"--threshold must be a finite confidence >= 0, got {args.threshold}")
    if not math.isfinite(args.temperature):
        raise CLIError(f"--temperature must be a finite number, got {args.temperature}")
    if not -SEED_LIMIT <= args.seed < SEED_LIMIT:
        raise CLIError(f"--seed must be in [-2**62, 2**62), got {args.seed}")
    if args.block_size is not None and args.block_size <= 0:
        raise CLIError(f"--block-size must be positive, got {args.block_size}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.top_k < 0 or not 0 < args.top_p <= 1:
        raise CLIError(f"--top-k must be >= 0 and --top-p in (0, 1], got {args.top_k}, {args.top_p}")
    if args.temperature < 0:
        raise CLIError(f"--temperature must be >= 0, got {args.temperature}")
    if args.steps_per_block is not None and not 1 <= args.steps_per_block <= STEPS_LIMIT:
        raise CLIError(f"--steps-per-block must be in [1, 2**31 - 1], got {args.steps_per_block}")
    check_sampling_flags(args)
    from .sampler_io import ignored_sampling_settings

    for text in ignored_sampling_settings(args.rule, args.steps_per_block, args.temperature, args.top_k, args.top_p):
        print(f"warning: {text}", file=sys.stderr, flush=True)


def check_sampling_flags(args) -> None:
    """The sampler's own check of its scalar arguments (`ops.unmask.check_sampling_args`, which every denoising
    step applies), now rather than after the model loaded: e.g. a --temperature of 1e-45 or 1e300, whose float32
    inverse is not finite. The message names the flag."""
    from .ops.unmask import check_sampling_args

    try:
        check_sampling_args(args.threshold, args.temperature, args.top_k, args.top_p, args.noise)
    except (ValueError, TypeError) as e:
        msg = str(e)
        for name, flag in SAMPLING_FLAGS.items():
            if msg.startswith(name + " "):
                msg = flag + msg[len(name):]
                break
        raise CLIError(msg) from None


def load_tokenizer_checked(model_dir: Path):
    """The checkpoint's tokenizer, errors as CLIError."""
    from .tokenizer import load_tokenizer

    try:
        return load_tokenizer(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise CLIError(f"cannot load the tokenizer of {model_dir}: {e}") from None


def load_model_checked(model_dir: Path, device: torch.device, dtype: torch.dtype):
    """The checkpoint's model (eval mode), errors as CLIError."""
    from .checkpoint import load_model

    try:
        model, _ = load_model(model_dir, dtype=dtype, device=device)
    except (OSError, ValueError, KeyError) as e:
        raise CLIError(f"cannot load the model in {model_dir}: {e}") from None
    return model


def read_config_checked(model_dir: Path):
    from .checkpoint import read_config

    try:
        return read_config(model_dir)
    except (OSError, ValueError, KeyError) as e:
        text = str(e)  # read_config's and read_json_file's messages start with the file already
        raise CLIError(text if str(model_dir) in text else f"cannot read {model_dir}/config.json: {text}") from None


def cli_main(build_parser, run, argv: Sequence[str] | None = None) -> int:
    """Parse, run, and turn a CLIError into one `error:` line and exit status 2 (shared by the CLIs)."""
    args = build_parser().parse_args(argv)
    try:
        with plain_warnings():
            run(args)
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def drop_stdout() -> None:
    """Point stdout at the null device after a BrokenPipeError (`... | head`): the interpreter's last flush of
    what a closed pipe did not take would print another BrokenPipeError on the way out."""
    import os

    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture): nothing to flush there
        pass
