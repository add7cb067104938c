r"""[cli] Decode prompts from a file with an SDAR checkpoint and write JSONL results.

    python -m lightningrl_fast.generate --model DIR --prompts FILE [--out FILE.jsonl]   (DIR: an SDAR checkpoint
        folder, or a training run's folder for its latest checkpoint: the one its `latest` file names, else its
        highest complete checkpoint-<step>; a run folder with no checkpoint yet is an error that says so)
        [--block-size B] [--threshold T] [--rule threshold|quota] [--steps-per-block S]
        [--temperature X] [--top-k K] [--top-p P] [--max-new-tokens N] [--batch-size N] [--seed S]
        [--chat/--no-chat] [--device auto|cpu|cuda[:i]] [--dtype auto|bfloat16|float16|float32] [--no-cuda-graphs]

Prompts file:
  * `.txt`: one prompt per non-blank line (the line's text, without its newline);
  * `.json`: a JSON array of rows, or {"data": [rows]}, or one row (as train's and eval's data files; a `.json`
    file of one object per line is read as JSONL);
  * anything else is read as JSONL: one JSON object per non-blank line.
A row is a JSON object with a non-empty string "prompt" (an optional "id" is copied to the output row).
Every row is checked (and tokenized, and checked against the checkpoint's vocabulary, its mask token id (not
allowed in a prompt) and max_position_embeddings, with the block size used: the last block, aligned at position
0, must end within the positions; `sampler.prompt_problem`) BEFORE the model is loaded; errors name the file and
the line (`file:line: ...`), or the element of a JSON array (`file[row i]: ...`, i from 0).
Lines end at "\n" / "\r\n" / "\r" only (a U+2028 inside a JSON string is not a line break); rows are strict
JSON (NaN / Infinity refused), and a "prompt" or "id" holding an unpaired surrogate (an escape such as
"\ud800", which is not text) is refused. The options are checked first too: ranges (a `--temperature` whose
float32 inverse is not finite, `--steps-per-block` past int32), `--device` cpu or cuda only, the block size
(`--block-size` or the checkpoint's) within the model's positions, and an `--out` whose folder exists and that
is neither the prompts file nor inside the model folder (real paths compared: symlinks resolved).
A checkpoint whose config mask_token_id differs from its tokenizer's mask token gets a warning on stderr (the
model's id is used, as train does).

`--chat` wraps each prompt in the ChatML user turn (`tokenizer.chat_prompt`); `--no-chat` feeds it as is; the
default is `--chat` where the tokenizer can encode the template (every SDAR tokenizer), else `--no-chat` (said
on stderr). Decoding is greedy unless `--temperature` > 0. `--max-new-tokens` defaults to 256, or, where the
model's positions cannot hold that after the longest prompt, to what they leave (said on stderr). `--block-size`
other than the checkpoint's also sets the model's attention block size for this run (the sampler's blocks and
the attention mask must agree).

Output: one JSON row per prompt, in input order — `prompt`, `text` (the response decoded, EOS dropped),
`tokens` (response length, EOS included), `token_ids`, `tpf`, `forwards` (forwards the row took part in),
`finish_reason` ("eos" or "length") and `id` when the input had one — to `--out`, or to stdout when `--out`
is absent (the summary then goes to stderr). `--out` is written to a hidden temporary file in its folder and
renamed over the target only when every row is written: an existing `--out` is never emptied or cut short. On
an error or Ctrl-C the rows written so far are kept in `<out>.partial` (the message says so) and `--out` is left
as it was (an `--out` that is not a regular file, such as /dev/null, is written directly).
The summary: tokens/s, forwards/s (the engine's forwards over the decode time), mean TPF, and the bandwidth
use: weight bytes per forward x forwards/s in GB/s and, on a GPU, its fraction of the measured device copy
bandwidth (KV-cache reads not counted: a lower bound on the bytes moved). A progress bar over batches uses tqdm
when it is installed.

Exit status: 0 on success; 2 on bad input (one `error: ...` line, no traceback); 130 on Ctrl-C (one `error:
interrupted ...` line naming the `.partial` file, if any); 141 (128 + SIGPIPE, what the shell reports for a
tool killed by a closed pipe) when stdout is closed early, e.g. `generate ... | head -c 10`: quietly, no
traceback.

Several GPUs: `torchrun --nproc-per-node N -m lightningrl_fast.generate ...` decodes batch g on rank g % N with
the seed a single process would use, and rank 0 writes the rows in input order: the same output, N times faster.

The plumbing this CLI shares with eval (CLIError, the flag / model-folder / device checks, the loaders,
`decode_texts`: one `Decoder.generate` call plus the decoded response texts) is in `_cli.py`. The CLI keeps one `sampler.Decoder` for all its
batches, so each working-set size is captured as a CUDA graph once per run, not once per batch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ._cli import (
    CLIError,
    _no_constant,
    add_decoding_args,
    batches,
    check_block_size,
    check_checkpoint_block_size,
    check_decoding_args,
    check_model_dir,
    cli_main,
    decode_block_size,
    decode_texts,
    drop_stdout,
    eos_ids_for,
    join_ranks,
    load_model_checked,
    load_tokenizer_checked,
    parse_json_line,
    progress,
    read_config_checked,
    resolve_dtype,
    sampler_config_from_args,
    split_lines,
    warn_mask_mismatch,
)
from .tasks.data import holds_json_lines, json_document_rows


@dataclass
class PromptRow:
    text: str
    line: int  # 1-based line in the prompts file (an element of a JSON array: its 0-based index)
    id: Any = None
    where: str = ""  # how errors name the row: `file:line`, or `file[row i]` for an element of a JSON array

    def location(self, path: str | Path) -> str:
        return self.where or f"{path}:{self.line}"


# ------------------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------------------

def _fail_rows(path: Path, errors: list[str], what: str) -> None:
    if errors:
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise CLIError(f"{len(errors)} {what} in {path}:\n  " + "\n  ".join(errors[:10]) + more)


def unpaired_surrogate(value: Any) -> str | None:
    """The first unpaired UTF-16 surrogate (e.g. from a JSON escape "\\ud800") in the strings of a JSON value, as
    `\\uXXXX`, or None: such a string is not text (the tokenizer refuses it, UTF-8 cannot write it back)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return f"\\u{ord(e.object[e.start]):04x}"
    except (RecursionError, ValueError):  # nested too deep to write back: not a surrogate question
        return None
    return None


def _prompt_row(obj: Any, line: int, where: str) -> PromptRow | str:
    """The PromptRow of one JSON row (a JSONL line or an element of a JSON array), or why it is not one (`where:
    why`)."""
    if not isinstance(obj, dict):
        return f"{where}: expected a JSON object with a \"prompt\" string, got {type(obj).__name__}"
    if "prompt" not in obj:
        return f"{where}: no \"prompt\" key (keys: {sorted(obj)})"
    p = obj["prompt"]
    if not isinstance(p, str):
        return f"{where}: \"prompt\" must be a string, got {type(p).__name__}"
    if not p.strip():
        return f"{where}: \"prompt\" is empty"
    bad = [(k, u) for k in ("prompt", "id") if (u := unpaired_surrogate(obj.get(k))) is not None]
    if bad:
        k, u = bad[0]
        return (f"{where}: \"{k}\" holds an unpaired surrogate {u} (an escape that is not a character: not valid "
                "Unicode text)")
    return PromptRow(p, line, obj.get("id"), where)


def _json_document_rows(text: str, path: Path) -> list[tuple[Any, int, str]]:
    """(row, index, `file[row i]`) of a `.json` prompts file holding one JSON document: an array of rows,
    {"data": [...]}, or a single row object (as train's and eval's data files). CLIError when it is not JSON
    (line and column named) or not of those forms."""
    try:
        doc = json.loads(text, parse_constant=_no_constant)  # strict JSON, as each JSONL line (parse_json_line)
    except json.JSONDecodeError as e:
        raise CLIError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # NaN / Infinity, > 4300-digit integers, nesting too deep
        raise CLIError(f"{path}: not valid JSON ({e})") from None
    rows = json_document_rows(doc)  # the data files' forms (tasks.data)
    if rows is None:
        raise CLIError(f"{path}: expected a JSON array of {{\"prompt\": ...}} objects (or {{\"data\": [...]}}), "
                       f"got {type(doc).__name__}")
    return [(obj, i, f"{path}[row {i}]") for i, obj in enumerate(rows)]


def read_prompts(path: str | Path) -> list[PromptRow]:
    """Rows of a prompts file (see the module docstring); CLIError listing every bad row as `file:line: why` (an
    element of a JSON array: `file[row i]: why`)."""
    path = Path(path)
    if not path.exists():
        raise CLIError(f"prompts file {path} does not exist")
    if not path.is_file():
        raise CLIError(f"prompts file {path} is not a file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark may lead
    except UnicodeDecodeError as e:
        raise CLIError(f"{path}: not UTF-8 text ({e})") from None
    lines = split_lines(text)
    rows: list[PromptRow] = []
    errors: list[str] = []
    suffix = path.suffix.lower()
    document = suffix == ".json" and bool(text.strip()) and not holds_json_lines(lines, parse_json_line)
    if document:
        for obj, i, where in _json_document_rows(text, path):
            row = _prompt_row(obj, i, where)
            (errors if isinstance(row, str) else rows).append(row)
        lines = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if suffix == ".txt":
            rows.append(PromptRow(line, lineno))
            continue
        try:
            obj = parse_json_line(line)
        except ValueError as e:
            errors.append(f"{path}:{lineno}: not valid JSON ({e})")
            continue
        row = _prompt_row(obj, lineno, f"{path}:{lineno}")
        (errors if isinstance(row, str) else rows).append(row)
    _fail_rows(path, errors, "malformed prompt row(s)")
    if not rows:
        raise CLIError(f"{path}: no prompts ({'an empty JSON array' if document else 'the file is empty or blank'})")
    return rows


DEFAULT_MAX_NEW_TOKENS = 256


def can_chat(tokenizer) -> bool:
    """Whether `tokenizer` encodes the ChatML user turn (`--chat`'s default): every SDAR BPE tokenizer does; a
    CharTokenizer whose alphabet lacks its letters (the embedded default's arithmetic one) does not."""
    from .tokenizer import chat_prompt

    try:
        tokenizer.encode(chat_prompt(""))
    except ValueError:
        return False
    return True


def fitted_max_new_tokens(prompt_lens: Sequence[int], max_len: int, block_size: int,
                          cap: int = DEFAULT_MAX_NEW_TOKENS) -> int:
    """The default response cap: `cap`, or less where the model's positions cannot hold it after the longest
    prompt (the last block, aligned at position 0, must end within them: `prompt + n <= (max_len // block_size)
    * block_size`). `cap` when even one new token does not fit the longest prompt: that prompt's error then names
    the positions."""
    room = (max_len // block_size) * block_size - max(prompt_lens, default=0)
    return min(cap, room) if room >= 1 else cap


def encode_prompts(rows: Sequence[PromptRow], tokenizer, path: str | Path, chat: bool, vocab_size: int,
                   max_len: int, max_new_tokens: int | None, mask_id: int, *,
                   block_size: int) -> tuple[list[list[int]], int]:
    """(token ids per row, max_new_tokens); CLIError naming `file:line` for rows that cannot be decoded with this
    checkpoint: `max_len` is its max_position_embeddings and `block_size` the decoding block size (the last block,
    aligned at position 0, must end within the positions: `sampler.prompt_problem`, the sampler's own rule).
    `max_new_tokens` None: `fitted_max_new_tokens` of the prompts that tokenize."""
    from .sampler import prompt_problem
    from .tokenizer import chat_prompt

    encoded, errors = [], []
    for r in rows:
        text = chat_prompt(r.text) if chat else r.text
        try:
            encoded.append((r, tokenizer.encode(text)))
        except ValueError as e:
            hint = " (try --no-chat)" if chat else ""
            errors.append((r.line, f"{r.location(path)}: cannot tokenize{hint}: {e}"))
    if max_new_tokens is None:
        max_new_tokens = fitted_max_new_tokens([len(ids) for _, ids in encoded], max_len, block_size)
    out = []
    for r, ids in encoded:
        problem = prompt_problem(ids, vocab_size, mask_id, max_new_tokens, block_size, None, max_len)
        if problem is not None:
            errors.append((r.line, f"{r.location(path)}: the prompt {problem.text}"))
            continue
        out.append(ids)
    _fail_rows(Path(path), [msg for _, msg in sorted(errors)], "prompt(s) that cannot be decoded")  # file order
    return out, max_new_tokens


def out_target(out: str | Path) -> Path:
    """The file --out names: a symlink stands for the file it points to (the results replace that file)."""
    p = Path(out)
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def partial_path(target: Path) -> Path:
    """Where the rows of a failed or interrupted run are left: `<out>.partial`, next to --out."""
    return target.with_name(target.name + ".partial")


def _inside(path: Path, folder: str | Path) -> bool:
    real, top = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return real == top or top in real.parents


def check_out_file(out: str | None, prompts: str | Path, model_dirs: Sequence[str | Path] = ()) -> None:
    """An --out file that can be created (with a temporary sibling: its folder must be writable), that is not the
    prompts file (the results would replace the prompts) and that is not inside a `model_dirs` folder (the --model
    folder as given and the checkpoint it stands for: writing there destroyed the checkpoint, e.g. its mmapped
    model.safetensors or its config.json). Real paths are compared: symlinks and `..` are resolved."""
    if out is None:
        return
    p = out_target(out)
    if p.is_dir():
        raise CLIError(f"--out {out} is a folder; give a file name")
    if not p.parent.is_dir():
        raise CLIError(f"--out {out}: the folder {p.parent} does not exist")
    for m in model_dirs:
        if _inside(p, m):
            raise CLIError(f"--out {out} is inside the model folder {m}: writing the results there would destroy the "
                           "checkpoint; write them elsewhere")
    if p.exists() and p.samefile(prompts):
        raise CLIError(f"--out {out} is the prompts file: writing the results would erase the prompts")
    if partial_path(p).exists() and partial_path(p).samefile(prompts):
        raise CLIError(f"--out {out}: {partial_path(p)} (where a failed run leaves its rows) is the prompts file")
    if p.exists() and not os.access(p, os.W_OK):
        raise CLIError(f"--out {out}: the file is not writable")
    if p.exists() and not p.is_file():
        return  # a device or a pipe (/dev/null, /dev/stdout): written directly, its folder is not written
    if not os.access(p.parent, os.W_OK | os.X_OK):
        raise CLIError(f"--out {out}: its folder {p.parent} is not writable")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during decoding; its text says where the rows written so far are (`main` prints it on one line)."""


class RowsOut:
    """Where the result rows go: stdout, or `--out` through a hidden temporary sibling that `commit` renames over
    it, so that an existing --out is replaced only by a complete result. `abandon` (after an error or Ctrl-C)
    leaves the rows written so far in `<out>.partial` and returns a note saying so. An --out that exists and is
    not a regular file (/dev/null, a pipe) is written directly."""

    def __init__(self, out: str | None) -> None:
        self.out, self.rows, self.tmp, self.done = out, 0, None, False
        if out is None:
            self.f = sys.stdout
            return
        self.target = out_target(out)
        self.existed = self.target.exists()
        try:
            if self.existed and not self.target.is_file():
                self.f = open(self.target, "w", encoding="utf-8")
            else:
                self.tmp = self.target.with_name(f".{self.target.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
                self.f = os.fdopen(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w",
                                   encoding="utf-8")
        except OSError as e:
            raise CLIError(f"cannot write --out {out}: {e.strerror or e}") from None

    def _io(self, what: str, fn, *a) -> None:
        if self.out is None:
            fn(*a)  # stdout: a BrokenPipeError goes up to `main`
            return
        try:
            fn(*a)
        except OSError as e:
            raise CLIError(f"cannot {what} --out {self.out}: {e.strerror or e}") from None

    def write(self, row: dict) -> None:
        self._io("write", self.f.write, json.dumps(row, ensure_ascii=False) + "\n")
        self.rows += 1

    def flush(self) -> None:
        self._io("write", self.f.flush)

    def commit(self) -> None:
        """Every row is written: the temporary file (synced, with the mode of the file it replaces) becomes --out."""
        self.flush()
        if self.out is None:
            return
        if self.tmp is not None:
            self._io("write", _fsync, self.f.fileno())
        self._io("close", self.f.close)
        if self.tmp is not None:
            if self.existed:
                with contextlib.suppress(OSError):
                    os.chmod(self.tmp, os.stat(self.target).st_mode & 0o7777)
            self._io("replace", os.replace, self.tmp, self.target)
        self.done = True

    def abandon(self) -> str:
        """After a failure: close; keep the rows so far in `<out>.partial` (none: remove the temporary file). The
        note for the error message."""
        if self.done:
            return ""
        self.done = True
        if self.out is None:
            return f"; {self.rows} row(s) had been written to stdout"
        with contextlib.suppress(OSError):
            self.f.close()
        if self.tmp is None:
            return f"; {self.rows} row(s) had been written to {self.out}"
        kept = f"{self.out} is left as it was" if self.existed else f"{self.out} was not created"
        if self.rows == 0:
            with contextlib.suppress(OSError):
                self.tmp.unlink()
            return f"; no row was written, {kept}"
        partial = partial_path(self.target)
        try:
            os.replace(self.tmp, partial)
        except OSError:
            partial = self.tmp
        return f"; the {self.rows} row(s) written so far are in {partial} ({kept})"


# ------------------------------------------------------------------------------------------------------------
# decoding
# ------------------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lightningrl_fast.generate",
                                 description="Decode prompts with an SDAR block-diffusion checkpoint.")
    ap.add_argument("--model", required=True,
                    help="checkpoint folder (config.json, safetensors, tokenizer), or a training run's folder: its "
                         "latest checkpoint (the one its `latest` file names, else its highest checkpoint-<step>)")
    ap.add_argument("--prompts", required=True, help="JSONL rows {\"prompt\": str}, a .json array of such rows, or a "
                    ".txt file, one prompt a line")
    ap.add_argument("--out", default=None,
                    help="output JSONL, replaced only by a complete result (on an error or Ctrl-C the rows so far go "
                         "to OUT.partial); not inside the model folder (default: stdout, summary on stderr)")
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                    help="wrap prompts in the ChatML user turn (default: on when the checkpoint's tokenizer can "
                         "encode that template, as every SDAR tokenizer can; off for the embedded default's "
                         "arithmetic alphabet)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    add_decoding_args(ap, max_new_tokens=None,
                      max_new_tokens_help=f"response length cap (default {DEFAULT_MAX_NEW_TOKENS}, or what the "
                                          "model's positions leave after the longest prompt when that is less)")
    return ap


def run(args) -> dict:
    """Everything `main` does; returns the summary dict. Raises CLIError for user errors. Under torchrun every
    rank runs it (see `_generate`)."""
    from .rl import distributed

    check_decoding_args(args)
    model_dir = check_model_dir(args.model)
    rows = read_prompts(args.prompts)
    check_out_file(args.out, args.prompts, model_dirs=(args.model, model_dir))
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
    check_checkpoint_block_size(args.block_size, mcfg.block_size, mcfg.max_position_embeddings, model_dir)
    tokenizer = load_tokenizer_checked(model_dir)
    if env.main:
        warn_mask_mismatch(tokenizer, mcfg)
    if env.main and not args.quiet and model_dir != Path(args.model):
        print(f"--model {args.model} is a training run folder: decoding its latest checkpoint {model_dir}",
              file=sys.stderr, flush=True)
    eos_ids = eos_ids_for(tokenizer, mcfg.vocab_size)
    if args.chat is None:
        args.chat = can_chat(tokenizer)
        if not args.chat and env.main and not args.quiet:
            print("prompts fed as they are (--no-chat): this tokenizer cannot encode the ChatML template",
                  file=sys.stderr, flush=True)
    bs = args.block_size or mcfg.block_size
    asked = args.max_new_tokens
    ids, args.max_new_tokens = encode_prompts(rows, tokenizer, args.prompts, args.chat, mcfg.vocab_size,
                                              mcfg.max_position_embeddings, asked, mcfg.mask_token_id, block_size=bs)
    if asked is None and args.max_new_tokens < DEFAULT_MAX_NEW_TOKENS and env.main and not args.quiet:
        print(f"max_new_tokens {args.max_new_tokens}: what the model's {mcfg.max_position_embeddings} positions "
              f"leave after the longest prompt ({max(map(len, ids))} tokens, block {bs}); --max-new-tokens sets it",
              file=sys.stderr, flush=True)
    cfg = sampler_config_from_args(args, eos_ids)

    model = load_model_checked(model_dir, device, dtype)
    log = sys.stdout if args.out else sys.stderr
    n_tok = n_fwd = 0
    seconds = 0.0
    tpfs: list[float] = []
    finish = {"eos": 0, "length": 0}
    groups = batches(len(ids), args.batch_size)
    decoder = Decoder(model)  # one engine for all batches: each working-set size is captured once per run
    bar = progress(len(groups), "generate", enabled=not args.quiet and env.main)
    out_f = None
    try:
        out_f = RowsOut(args.out) if env.main else None  # (inside: a Ctrl-C right after it still cleans up)
        with decode_block_size(model, args.block_size), nvtx_range("generate"):
            for g0 in range(0, len(groups), env.world):  # one round: batch g0 + rank on each rank
                g = g0 + env.rank
                out_rows: list[dict] = []
                if g < len(groups):
                    idx = groups[g]
                    bcfg = dataclasses.replace(cfg, seed=cfg.seed + g)  # distinct Philox streams per batch
                    t0 = time.perf_counter()
                    try:
                        ro, texts = decode_texts(model, tokenizer, [ids[i] for i in idx], bcfg, decoder)
                    except ValueError as e:  # what the sampler refuses (as eval reports it)
                        raise CLIError(f"cannot decode batch {g + 1} of {len(groups)}: {e}") from None
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
                            out_f.write(row)
                    bar.update(1 if part else 0)
                if out_f is not None:
                    out_f.flush()
                bar.set_postfix_str(f"{n_tok / max(seconds, 1e-9):.1f} tok/s")
        if out_f is not None:
            out_f.commit()
    except CLIError as e:
        raise CLIError(f"{e}{_abandon(out_f)}") from None
    except BrokenPipeError:
        raise  # stdout closed early (`| head`): `main` exits quietly
    except KeyboardInterrupt:
        raise Interrupted(_abandon(out_f)) from None
    except BaseException as e:  # an unexpected failure keeps its traceback, and says where the rows are
        note = _abandon(out_f)
        if note and hasattr(e, "add_note"):  # Python >= 3.11: printed under the traceback
            e.add_note(f"generate: the results were not finished{note}")
        elif note:
            print(f"generate: the results were not finished{note}", file=sys.stderr, flush=True)
        raise
    finally:
        bar.close()
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


def _fsync(fd: int) -> None:
    """Flush a file to the disk before it replaces --out; a file system without fsync (EINVAL) is not an error."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise


def _abandon(out_f: "RowsOut | None") -> str:
    return out_f.abandon() if out_f is not None else ""


def main(argv: Sequence[str] | None = None) -> int:
    """The command line. Exit status (module docstring): 0; 2 for bad input (`error:` line); 130 on Ctrl-C (one
    `error: interrupted` line saying where the rows written so far are); 141 when stdout was closed early."""
    try:
        return cli_main(build_parser, run, argv)
    except KeyboardInterrupt as e:  # `Interrupted` carries the note on the rows so far
        print(f"error: interrupted (Ctrl-C){e}", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:  # `generate ... | head`: the reader has all it wanted
        drop_stdout()
        return 141


if __name__ == "__main__":
    sys.exit(main())
