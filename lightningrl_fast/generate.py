r"""[cli] Decode prompts from a file with an SDAR checkpoint and write JSONL results.

    python -m lightningrl_fast.generate --model DIR --prompts FILE [--out FILE.jsonl]   (DIR: an SDAR checkpoint
        folder, or a training run's folder for its latest checkpoint)
        [--block-size B] [--threshold T] [--rule threshold|quota] [--steps-per-block S]
        [--temperature X] [--top-k K] [--top-p P] [--max-new-tokens N] [--batch-size N] [--seed S]
        [--chat/--no-chat] [--device auto|cpu|cuda[:i]] [--dtype auto|bfloat16|float16|float32] [--no-cuda-graphs]

Prompts file:
  * `.txt`: one prompt per non-blank line (the line's text, without its newline);
  * anything else is read as JSONL: one JSON object per non-blank line with a non-empty string "prompt"
    (an optional "id" is copied to the output row).
Every row is checked (and tokenized, and checked against the checkpoint's vocabulary and
max_position_embeddings) BEFORE the model is loaded; errors name the file and the line (`file:line: ...`).
Lines end at "\n" / "\r\n" / "\r" only (a U+2028 inside a JSON string is not a line break); rows are strict
JSON (NaN / Infinity refused). The options are checked first too: ranges, `--block-size` within the model's
positions, and an `--out` whose folder exists and that is not the prompts file.

`--chat` (default) wraps each prompt in the ChatML user turn (`tokenizer.chat_prompt`); `--no-chat` feeds it
as is. Decoding is greedy unless `--temperature` > 0. `--block-size` other than the checkpoint's also sets the
model's attention block size for this run (the sampler's blocks and the attention mask must agree).

Output: one JSON row per prompt, in input order — `prompt`, `text` (the response decoded, EOS dropped),
`tokens` (response length, EOS included), `token_ids`, `tpf`, `forwards` (forwards the row took part in),
`finish_reason` ("eos" or "length") and `id` when the input had one — to `--out`, or to stdout when `--out`
is absent (the summary then goes to stderr). The summary: tokens/s, forwards/s (the engine's forwards over the
decode time), mean TPF, and the bandwidth use: weight bytes per forward x forwards/s in GB/s and, on a GPU, its
fraction of the measured device copy bandwidth (KV-cache reads not counted: a lower bound on the bytes moved). A progress bar over batches uses tqdm when it is installed.

Several GPUs: `torchrun --nproc-per-node N -m lightningrl_fast.generate ...` decodes batch g on rank g % N with
the seed a single process would use, and rank 0 writes the rows in input order: the same output, N times faster.

`decode_texts(model, tokenizer, prompt_ids, cfg, decoder)` is the shared helper (eval.py uses it): one
`Decoder.generate` call plus the decoded response texts. The CLI keeps one `sampler.Decoder` for all its
batches, so each working-set size is captured as a CUDA graph once per run, not once per batch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}


class CLIError(Exception):
    """A user error the command line reports as `error: ...` (exit status 2), without a traceback."""


@dataclass
class PromptRow:
    text: str
    line: int  # 1-based line in the prompts file
    id: Any = None


# ------------------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------------------

def _fail_rows(path: Path, errors: list[str], what: str) -> None:
    if errors:
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise CLIError(f"{len(errors)} {what} in {path}:\n  " + "\n  ".join(errors[:10]) + more)


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


def read_prompts(path: str | Path) -> list[PromptRow]:
    """Rows of a prompts file (see the module docstring); CLIError listing every bad row as `file:line: why`."""
    path = Path(path)
    if not path.exists():
        raise CLIError(f"prompts file {path} does not exist")
    if not path.is_file():
        raise CLIError(f"prompts file {path} is not a file")
    try:
        lines = split_lines(path.read_text(encoding="utf-8-sig"))  # a byte-order mark may lead
    except UnicodeDecodeError as e:
        raise CLIError(f"{path}: not UTF-8 text ({e})") from None
    rows: list[PromptRow] = []
    errors: list[str] = []
    plain = path.suffix.lower() == ".txt"
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if plain:
            rows.append(PromptRow(line, lineno))
            continue
        try:
            obj = parse_json_line(line)
        except ValueError as e:
            errors.append(f"{path}:{lineno}: not valid JSON ({e})")
            continue
        if not isinstance(obj, dict):
            errors.append(f"{path}:{lineno}: expected a JSON object with a \"prompt\" string, got {type(obj).__name__}")
            continue
        if "prompt" not in obj:
            errors.append(f"{path}:{lineno}: no \"prompt\" key (keys: {sorted(obj)})")
            continue
        p = obj["prompt"]
        if not isinstance(p, str):
            errors.append(f"{path}:{lineno}: \"prompt\" must be a string, got {type(p).__name__}")
            continue
        if not p.strip():
            errors.append(f"{path}:{lineno}: \"prompt\" is empty")
            continue
        rows.append(PromptRow(p, lineno, obj.get("id")))
    _fail_rows(path, errors, "malformed prompt row(s)")
    if not rows:
        raise CLIError(f"{path}: no prompts (the file is empty or blank)")
    return rows


def encode_prompts(rows: Sequence[PromptRow], tokenizer, path: str | Path, chat: bool, vocab_size: int,
                   max_len: int, max_new_tokens: int, mask_id: int) -> list[list[int]]:
    """Token ids per row; CLIError naming `file:line` for rows that cannot be decoded with this checkpoint."""
    from .tokenizer import chat_prompt

    out, errors = [], []
    for r in rows:
        text = chat_prompt(r.text) if chat else r.text
        where = f"{path}:{r.line}"
        try:
            ids = tokenizer.encode(text)
        except ValueError as e:
            hint = " (try --no-chat)" if chat else ""
            errors.append(f"{where}: cannot tokenize{hint}: {e}")
            continue
        if not ids:
            errors.append(f"{where}: the prompt encodes to no tokens")
            continue
        bad = sorted({t for t in ids if t >= vocab_size})
        if bad:
            errors.append(f"{where}: token id(s) {bad[:5]} are outside the model's vocabulary [0, {vocab_size})")
            continue
        if mask_id in ids:
            errors.append(f"{where}: the prompt contains the mask token (id {mask_id})")
            continue
        if len(ids) + max_new_tokens > max_len:
            errors.append(f"{where}: {len(ids)} prompt tokens + max_new_tokens {max_new_tokens} exceed the model's "
                          f"max_position_embeddings {max_len}")
            continue
        out.append(ids)
    _fail_rows(Path(path), errors, "prompt(s) that cannot be decoded")
    return out


def check_block_size(block_size: int | None, max_len: int) -> None:
    """A --block-size larger than the model's positions would decode past them (and allocate a cache that wide)."""
    if block_size is not None and block_size > max_len:
        raise CLIError(f"--block-size {block_size} exceeds the model's max_position_embeddings {max_len}")


def check_out_file(out: str | None, prompts: str | Path) -> None:
    """An --out file that can be created, and is not the prompts file (opening it would erase the prompts)."""
    if out is None:
        return
    p = Path(out)
    if p.is_dir():
        raise CLIError(f"--out {out} is a folder; give a file name")
    if not p.parent.is_dir():
        raise CLIError(f"--out {out}: the folder {p.parent} does not exist")
    if not os.access(p if p.exists() else p.parent, os.W_OK):
        raise CLIError(f"--out {out}: {'the file' if p.exists() else 'its folder'} is not writable")
    if p.exists() and p.samefile(prompts):
        raise CLIError(f"--out {out} is the prompts file: writing the results would erase the prompts")


def check_model_dir(path: str | Path) -> Path:
    """The checkpoint folder, or CLIError (missing folder / config.json), before anything heavy is loaded. A
    training run's output folder stands for its latest checkpoint (the one its `latest` file names)."""
    from .rl.checkpointing import LATEST, resolve_checkpoint

    p = Path(path)
    if not p.exists():
        raise CLIError(f"model folder {p} does not exist")
    if not p.is_dir():
        raise CLIError(f"--model {p} is not a folder (expected an SDAR checkpoint folder with config.json)")
    if (p / LATEST).is_file():  # a run folder (its config.json is the run's): its latest checkpoint
        try:
            p = resolve_checkpoint(p)
        except (OSError, ValueError) as e:
            raise CLIError(f"--model {path}: a run folder whose latest checkpoint cannot be found ({e})") from None
    if not (p / "config.json").is_file():
        raise CLIError(f"model folder {p} has no config.json")
    return p


def join_ranks(device_name: str):
    """(env, device) of this process for a CLI: under torchrun its rank joined to the process group (one GPU per
    rank), else the single process on `--device`. Leave the group with `distributed.joined(env)`."""
    from .rl import distributed

    try:
        return distributed.init(distributed.env_from_environment(), distributed.resolve_device(device_name))
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


# ------------------------------------------------------------------------------------------------------------
# decoding
# ------------------------------------------------------------------------------------------------------------

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
                         cuda_graphs=not args.no_cuda_graphs, seed=args.seed)


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


SEED_LIMIT = 2**62  # Philox seeds are int64; each batch adds its index


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
    if args.steps_per_block is not None and args.steps_per_block < 1:
        raise CLIError(f"--steps-per-block must be >= 1, got {args.steps_per_block}")


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
        raise CLIError(f"cannot read {model_dir}/config.json: {e}") from None


# ------------------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lightningrl_fast.generate",
                                 description="Decode prompts with an SDAR block-diffusion checkpoint.")
    ap.add_argument("--model", required=True, help="checkpoint folder (config.json, safetensors, tokenizer)")
    ap.add_argument("--prompts", required=True, help="JSONL rows {\"prompt\": str} or a .txt file, one prompt a line")
    ap.add_argument("--out", default=None, help="output JSONL (default: stdout, summary on stderr)")
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                    help="wrap prompts in the ChatML user turn (default: on)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    add_decoding_args(ap)
    return ap


def run(args) -> dict:
    """Everything `main` does; returns the summary dict. Raises CLIError for user errors. Under torchrun every
    rank runs it (see `_generate`)."""
    from .rl import distributed

    check_decoding_args(args)
    model_dir = check_model_dir(args.model)
    rows = read_prompts(args.prompts)
    check_out_file(args.out, args.prompts)
    env, device = join_ranks(args.device)
    with distributed.joined(env):
        return _generate(args, env, device, model_dir, rows)


def _generate(args, env, device, model_dir: Path, rows: list) -> dict:
    """Decode every prompt in batches, write JSONL rows in prompt order as batches finish, print the summary.

    Several ranks: batch g (the same batches and Philox seeds as one process) is decoded by rank g % world; after
    each round of `world` batches the rows are all-gathered and rank 0 writes them in order, so the output equals
    a one-process run's, with N times the decode throughput (tokens/s over the slowest rank's decode time)."""
    from .profiling import copy_bandwidth_gbs, nvtx_range
    from .rl.distributed import all_gather
    from .sampler import Decoder

    dtype = resolve_dtype(args.dtype, device)
    mcfg = read_config_checked(model_dir)
    check_block_size(args.block_size, mcfg.max_position_embeddings)
    tokenizer = load_tokenizer_checked(model_dir)
    eos_ids = eos_ids_for(tokenizer, mcfg.vocab_size)
    ids = encode_prompts(rows, tokenizer, args.prompts, args.chat, mcfg.vocab_size, mcfg.max_position_embeddings,
                         args.max_new_tokens, mcfg.mask_token_id)
    cfg = sampler_config_from_args(args, eos_ids)

    model = load_model_checked(model_dir, device, dtype)
    try:
        out_f = (open(args.out, "w", encoding="utf-8") if args.out else sys.stdout) if env.main else None
    except OSError as e:
        raise CLIError(f"cannot write --out {args.out}: {e.strerror or e}") from None
    log = sys.stdout if args.out else sys.stderr
    n_tok = n_fwd = 0
    seconds = 0.0
    tpfs: list[float] = []
    finish = {"eos": 0, "length": 0}
    groups = batches(len(ids), args.batch_size)
    bar = progress(len(groups), "generate", enabled=not args.quiet and env.main)
    decoder = Decoder(model)  # one engine for all batches: each working-set size is captured once per run
    try:
        with decode_block_size(model, args.block_size), nvtx_range("generate"):
            for g0 in range(0, len(groups), env.world):  # one round: batch g0 + rank on each rank
                g = g0 + env.rank
                out_rows: list[dict] = []
                if g < len(groups):
                    idx = groups[g]
                    bcfg = dataclasses.replace(cfg, seed=cfg.seed + g)  # distinct Philox streams per batch
                    t0 = time.perf_counter()
                    ro, texts = decode_texts(model, tokenizer, [ids[i] for i in idx], bcfg, decoder)
                    seconds += time.perf_counter() - t0
                    n_fwd += ro.total_forwards
                    for j, i in enumerate(idx):
                        row = {"prompt": rows[i].text, "text": texts[j], "tokens": int(ro.lengths[j]),
                               "token_ids": ro.response_ids(j), "tpf": round(float(ro.tpf[j]), 4),
                               "forwards": int(ro.forwards[j]), "finish_reason": ro.finish_reason[j]}
                        out_rows.append({"id": rows[i].id, **row} if rows[i].id is not None else row)
                        tpfs.append(float(ro.tpf[j]))
                for part in (all_gather(env, out_rows) if env.active else [out_rows]):  # batch order
                    for row in part:
                        n_tok += row["tokens"]
                        finish[row["finish_reason"]] = finish.get(row["finish_reason"], 0) + 1
                        if out_f is not None:
                            out_f.write(json.dumps(row, ensure_ascii=False) + "\n")
                    bar.update(1 if part else 0)
                if out_f is not None:
                    out_f.flush()
                bar.set_postfix_str(f"{n_tok / max(seconds, 1e-9):.1f} tok/s")
    finally:
        bar.close()
        if out_f is not None and out_f is not sys.stdout:
            out_f.close()
    if env.active:
        parts = all_gather(env, (seconds, n_fwd, sum(tpfs), len(tpfs)))
        seconds, n_fwd = max(p[0] for p in parts), sum(p[1] for p in parts)
        mean_tpf = sum(p[2] for p in parts) / max(1, sum(p[3] for p in parts))
    else:
        mean_tpf = sum(tpfs) / len(tpfs)
    summary = {
        "prompts": len(ids), "batches": len(groups), "tokens": n_tok, "forwards": n_fwd, "seconds": round(seconds, 4),
        "tokens_per_s": n_tok / seconds if seconds > 0 else math.nan,
        "forwards_per_s": n_fwd / seconds if seconds > 0 else math.nan,
        "mean_tpf": mean_tpf, "finish": finish, "device": str(device), "dtype": str(dtype)[6:],
        "block_size": cfg.block_size or model.config.block_size, "threshold": cfg.threshold, "ranks": env.world,
    }
    wbytes = model.forward_weight_bytes()
    summary["weight_gb_per_forward"] = wbytes / 1e9
    summary["weight_gbs"] = wbytes * n_fwd / seconds / 1e9 if seconds > 0 else math.nan
    copy = copy_bandwidth_gbs(device) if env.main else None
    summary["copy_gbs"] = copy
    summary["bandwidth_use"] = summary["weight_gbs"] / env.world / copy if copy else None  # per GPU
    if not env.main:
        return summary
    ranks = f" x {env.world} ranks" if env.active else ""
    print(f"prompts {summary['prompts']} in {summary['batches']} batch(es) on {device}{ranks} ({summary['dtype']}); "
          f"generated {n_tok} tokens in {seconds:.2f} s", file=log)
    print(f"tokens/s {summary['tokens_per_s']:.1f}  forwards/s {summary['forwards_per_s']:.1f}  "
          f"mean TPF {summary['mean_tpf']:.3f}  (forwards {n_fwd}; finish: eos {finish.get('eos', 0)}, "
          f"length {finish.get('length', 0)})", file=log)
    use = (f" = {100 * summary['bandwidth_use']:.1f}% of the device copy bandwidth ({copy:.0f} GB/s)"
           f"{' per GPU' if env.active else ''}"
           if summary["bandwidth_use"] is not None else "")
    print(f"weights streamed {summary['weight_gbs']:.4g} GB/s ({summary['weight_gb_per_forward']:.4g} GB per forward"
          f"; KV-cache reads not counted){use}", file=log)
    if args.out:
        print(f"wrote {args.out}", file=log)
    return summary


def cli_main(build_parser, run, argv: Sequence[str] | None = None) -> int:
    """Parse, run, and turn a CLIError into one `error:` line and exit status 2 (shared by the CLIs)."""
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
