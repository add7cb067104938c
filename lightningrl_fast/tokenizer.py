"""Tokenizers: the Qwen2 byte-level BPE of SDAR checkpoints, a tiny char-level one, and the ChatML template.

`load_tokenizer(path)` returns a `Tokenizer`: one interface for every tokenizer the package uses

    encode(text) -> list[int]            no BOS is ever added; special tokens written in the text
                                         (`<|im_end|>`, `<|MASK|>`, ...) encode to their single ids
    decode(ids, skip_special=False)      -> str; ids outside the tokenizer's vocabulary (a model's padded
                                         vocab_size is larger: 151936 vs 151670) are dropped, as HF does
    vocab_size, mask_token_id, eos_token_ids (set), pad_token_id, special_tokens {content: id},
    special_id(content), im_start_id, im_end_id, token_to_id / id_to_token, save(folder)

Where it comes from, in order:
  * a folder with `tokenizer.json` (what real SDAR downloads carry): read by the `tokenizers` package;
  * a folder with `vocab.json` + `merges.txt` (no tokenizer.json): the Qwen2 tokenizer is rebuilt with the
    `tokenizers` package exactly as Qwen2's tokenizer.json defines it — NFC normalizer; pre-tokenizer
    Sequence[Split(QWEN2_PRETOKENIZE_PATTERN, isolated), ByteLevel(add_prefix_space=False, use_regex=False)];
    BPE without unk token; ByteLevel decoder; no post-processor (no BOS). Added tokens come from
    `tokenizer_config.json["added_tokens_decoder"]` (ids, special flags as declared), then from the legacy
    `added_tokens.json` for ids/contents not declared there (the transformers rule);
  * a folder saved by `CharTokenizer.save` (`tokenizer_config.json` names it): a `CharTokenizer`.

Special ids: eos = the config's `eos_token` plus `<|im_end|>` and `<|endoftext|>` when present, plus
`generation_config.json["eos_token_id"]` (SDAR stops on 151645 or 151643); pad = `pad_token` (else
`<|endoftext|>`, else the smallest eos id); mask = `mask_token` (else `config.json["mask_token_id"]`, else
`<|MASK|>` / `<MASK>`). Note: SDAR declares `<|MASK|>` with special=False, so `skip_special` keeps it, as
the real tokenizer does.

`CharTokenizer(alphabet)` is the tokenizer of the embedded synthetic tasks: ids 0..3 are `<|endoftext|>`,
`<|im_start|>`, `<|im_end|>`, `<|MASK|>`, then one id per alphabet character in order. It saves a real
`tokenizer.json` (WordLevel over single characters) that the `tokenizers` package reads back, so a
synthetic model folder looks like an SDAR one. Characters outside the alphabet raise a ValueError naming them.

`chat_prompt(user_text, system=None)` is the ChatML prompt SDAR chat models expect.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from ._jsonfile import read_json_file

# The Qwen2 pre-tokenization regex (transformers' tokenization_qwen2.PRETOKENIZE_REGEX; the Split pattern of
# every Qwen2/Qwen2.5/Qwen3 tokenizer.json). Single digits (\p{N} without a repeat), GPT-4-like otherwise.
QWEN2_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

ENDOFTEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"

# Files a tokenizer folder may carry besides tokenizer.json / tokenizer_config.json (copied by `save`): the
# slow tokenizer's vocab.json / merges.txt / added_tokens.json are what the `auto_map` Qwen2Tokenizer of an
# SDAR folder reads under transformers' trust_remote_code.
_EXTRA_FILES = ("vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json", "chat_template.jinja",
                "generation_config.json")


def chat_prompt(user_text: str, system: str | None = None) -> str:
    """The ChatML prompt: optional system turn, the user turn, then the opened assistant turn."""
    head = f"{IM_START}system\n{system}{IM_END}\n" if system is not None else ""
    return f"{head}{IM_START}user\n{user_text}{IM_END}\n{IM_START}assistant\n"


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _token_ids(value: Any, where: str) -> list[int]:
    """A token id or a list of them (generation_config's eos_token_id), checked: ValueError naming `where`."""
    ids = value if isinstance(value, list) else [value]
    if not all(_is_id(i) for i in ids):
        raise ValueError(f"{where} must be a non-negative integer token id or a list of them, got {value!r}")
    return ids


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, an AddedToken dict, or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):  # torch / numpy
        ids = ids.tolist()
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special ids SDAR code needs. Build with `load_tokenizer`."""

    def __init__(self, backend: tokenizers.Tokenizer, *, eos_tokens: Iterable[str] = (), pad_token: str | None = None,
                 mask_token: str | None = None, mask_token_id: int | None = None, eos_ids: Iterable[int] = (),
                 config: dict | None = None, source_dir: Path | None = None) -> None:
        self.backend = backend
        self.config = dict(config or {})  # tokenizer_config.json, written back by save()
        self.source_dir = source_dir
        self.special_tokens: dict[str, int] = {
            t.content: i for i, t in sorted(backend.get_added_tokens_decoder().items())
        }
        self._special_flag = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        eos = {self._id_of(t) for t in eos_tokens if t and self.token_to_id(t) is not None}
        eos |= {int(i) for i in eos_ids}
        self.eos_token_ids: set[int] = eos
        if pad_token is not None and self.token_to_id(pad_token) is None:
            raise ValueError(f"pad token {pad_token!r} is not in the vocabulary")
        self.pad_token_id: int | None = self.token_to_id(pad_token) if pad_token is not None else None
        if self.pad_token_id is None and eos:
            self.pad_token_id = min(eos)
        if mask_token is not None:
            if self.token_to_id(mask_token) is None:
                raise ValueError(f"mask token {mask_token!r} is not in the vocabulary")
            mask_token_id = self.token_to_id(mask_token)
        self.mask_token_id: int | None = mask_token_id

    # -- vocabulary ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary + added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def _id_of(self, token: str) -> int:
        i = self.token_to_id(token)
        if i is None:
            raise KeyError(f"token {token!r} is not in the vocabulary")
        return i

    @property
    def im_start_id(self) -> int | None:
        return self.special_tokens.get(IM_START)

    @property
    def im_end_id(self) -> int | None:
        return self.special_tokens.get(IM_END)

    def special_id(self, name: str) -> int:
        """Id of an added/special token by its content, e.g. special_id('<|im_end|>') -> 151645."""
        if name not in self.special_tokens:
            raise KeyError(f"{name!r} is not a special token of this tokenizer; known: {sorted(self.special_tokens)}")
        return self.special_tokens[name]

    # -- encode / decode ---------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS; special tokens in the text become their ids)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Any, skip_special: bool = False) -> str:
        """Text of `ids` (a list, tuple, or 1-D tensor). skip_special drops tokens flagged special."""
        return self.backend.decode(_as_id_list(ids), skip_special_tokens=skip_special)

    def decode_batch(self, batch: Sequence[Any], skip_special: bool = False) -> list[str]:
        return [self.decode(ids, skip_special) for ids in batch]

    # -- persistence ---------------------------------------------------------------------------------------
    def _tokenizer_config(self) -> dict:
        cfg = dict(self.config)
        decoder = self.backend.get_added_tokens_decoder()
        cfg["added_tokens_decoder"] = {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in sorted(decoder.items())
        }
        cfg.setdefault("add_bos_token", False)
        cfg.setdefault("bos_token", None)
        id_to_content = {i: c for c, i in self.special_tokens.items()}
        if self.pad_token_id is not None and self.pad_token_id in id_to_content:
            cfg.setdefault("pad_token", id_to_content[self.pad_token_id])
        if self.mask_token_id is not None and self.mask_token_id in id_to_content:
            cfg.setdefault("mask_token", id_to_content[self.mask_token_id])
        return cfg

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json + tokenizer_config.json, and from the source folder its vocabulary, template and map
        files and the tokenizer code module its `auto_map` names."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"), pretty=True)
        (folder / "tokenizer_config.json").write_text(json.dumps(self._tokenizer_config(), indent=2, ensure_ascii=False) + "\n",
                                                      encoding="utf-8")
        if self.source_dir is not None:
            from .checkpoint import auto_map_modules

            for name in (*_EXTRA_FILES, *auto_map_modules(self.config)):
                src = self.source_dir / name
                if src.is_file() and not (folder / name).exists():
                    shutil.copyfile(src, folder / name)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, mask={self.mask_token_id}, "
                f"eos={sorted(self.eos_token_ids)}, pad={self.pad_token_id})")


# ------------------------------------------------------------------------------------------------------------
# Qwen2 byte-level BPE from vocab.json + merges.txt
# ------------------------------------------------------------------------------------------------------------

def _read_merges(path: Path) -> list[tuple[str, str]]:
    merges = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line or (lineno == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: a merge must be two space-separated symbols, got {line!r}")
            merges.append((parts[0], parts[1]))
    return merges


def _added_tokens(folder: Path, config: dict) -> list[tuple[int, AddedToken]]:
    """Added tokens by id: tokenizer_config's added_tokens_decoder, then legacy added_tokens.json."""
    out: dict[int, AddedToken] = {}
    where = f"{folder / 'tokenizer_config.json'}: added_tokens_decoder"
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise ValueError(f"{where} must be an object of id -> token, got {type(decoder).__name__}")
    flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
    for key, t in decoder.items():
        if not key.isdigit():
            raise ValueError(f"{where}: key {key!r} is not a token id")
        if not (isinstance(t, dict) and isinstance(t.get("content"), str) and t["content"]):
            raise ValueError(f"{where}[{key!r}] must be an object with a non-empty string \"content\", got {t!r}")
        bad = [f for f in flags if f in t and not isinstance(t[f], bool)]
        if bad:
            raise ValueError(f"{where}[{key!r}]: {', '.join(bad)} must be true or false")
        out[int(key)] = AddedToken(t["content"], single_word=t.get("single_word", False), lstrip=t.get("lstrip", False),
                                   rstrip=t.get("rstrip", False), normalized=t.get("normalized", False),
                                   special=t.get("special", True))
    legacy = folder / "added_tokens.json"
    if legacy.is_file():
        contents = {t.content for t in out.values()}
        for content, i in read_json_file(legacy).items():
            if not _is_id(i):
                raise ValueError(f"{legacy}: the id of {content!r} must be a non-negative integer, got {i!r}")
            if i not in out and content not in contents:
                out[i] = AddedToken(content, normalized=False, special=True)
    return sorted(out.items())


def build_qwen2_bpe(folder: str | Path, config: dict | None = None) -> tokenizers.Tokenizer:
    """The Qwen2 tokenizer (as its tokenizer.json defines it) from vocab.json + merges.txt + added tokens."""
    folder = Path(folder)
    for name in ("vocab.json", "merges.txt"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder} has neither tokenizer.json nor {name}")
    if config is None:
        config = read_json_file(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    vocab: dict[str, int] = read_json_file(folder / "vocab.json")
    bad = [(t, i) for t, i in vocab.items() if not _is_id(i)]
    if bad:
        raise ValueError(f"{folder / 'vocab.json'}: token ids must be non-negative integers; "
                         f"{len(bad)} are not, e.g. {bad[0][0]!r}: {bad[0][1]!r}")
    added = _added_tokens(folder, config)
    # Added tokens whose ids do not continue the base vocabulary contiguously must sit in the model's
    # vocabulary at their ids; when they do continue it (Qwen2), they stay out of it, as in tokenizer.json.
    next_id = max(vocab.values(), default=-1) + 1
    contiguous = [i for i, _ in added] == list(range(next_id, next_id + len(added))) and len(vocab) == next_id
    if not contiguous:
        vocab = dict(vocab)
        for i, t in added:
            vocab.setdefault(t.content, i)
    try:
        bpe = models.BPE(vocab=vocab, merges=_read_merges(folder / "merges.txt"), unk_token=None, fuse_unk=False,
                         byte_fallback=False, continuing_subword_prefix="", end_of_word_suffix="")
    except ValueError:
        raise
    except Exception as e:  # the Rust error (e.g. a merge of a symbol vocab.json lacks) says what; add where
        raise ValueError(f"vocab.json and merges.txt of {folder} do not form a BPE model: {e}") from None
    tok = tokenizers.Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for i, t in added:
        tok.add_tokens([t])
        got = tok.token_to_id(t.content)
        if got != i:
            raise ValueError(f"added token {t.content!r} should have id {i} but got {got} (inconsistent vocab.json / "
                             f"tokenizer_config.json in {folder})")
    return tok


# ------------------------------------------------------------------------------------------------------------
# Char-level tokenizer for synthetic tasks
# ------------------------------------------------------------------------------------------------------------

CHAR_SPECIALS = (ENDOFTEXT, IM_START, IM_END, MASK)  # ids 0, 1, 2, 3
# Digits, arithmetic, the trace punctuation (`6+4=10,10+5=15#15`), space, newline, lowercase letters (enough for
# the ChatML role names and short words). Pass your own alphabet for other tasks.
DEFAULT_ALPHABET = "0123456789+-*/=()<>,.:;#? \nabcdefghijklmnopqrstuvwxyz"
_CHAR_KIND = "lightningrl_char"


class CharTokenizer(Tokenizer):
    """One id per character of a fixed alphabet; the four ChatML/SDAR specials take ids 0..3."""

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if not isinstance(alphabet, str) or not alphabet:
            raise ValueError("CharTokenizer alphabet must be a non-empty string")
        dup = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if dup:
            raise ValueError(f"CharTokenizer alphabet repeats character(s) {dup!r}")
        self.alphabet = alphabet
        vocab = {tok: i for i, tok in enumerate(CHAR_SPECIALS)}
        vocab.update({c: len(CHAR_SPECIALS) + i for i, c in enumerate(alphabet)})
        backend = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated", invert=False)
        backend.decoder = decoders.Fuse()
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in CHAR_SPECIALS])
        self._char_to_id = {c: i for c, i in vocab.items() if c not in CHAR_SPECIALS}
        self._id_to_str = {i: c for c, i in vocab.items()}
        self._split = re.compile("(" + "|".join(re.escape(t) for t in CHAR_SPECIALS) + ")")
        super().__init__(backend, eos_tokens=(ENDOFTEXT, IM_END), pad_token=ENDOFTEXT, mask_token=MASK,
                         config={"tokenizer_class": "PreTrainedTokenizerFast", "lightningrl_tokenizer": _CHAR_KIND,
                                 "alphabet": alphabet, "eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT,
                                 "mask_token": MASK, "model_max_length": 1 << 20})

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids: list[int] = []
        pos = 0
        for piece in self._split.split(text):
            if piece in self.special_tokens:
                ids.append(self.special_tokens[piece])
            else:
                for j, c in enumerate(piece):
                    i = self._char_to_id.get(c)
                    if i is None:
                        raise ValueError(f"character {c!r} (U+{ord(c):04X}) at position {pos + j} of {text!r} is not in "
                                         f"the CharTokenizer alphabet {self.alphabet!r}")
                    ids.append(i)
            pos += len(piece)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Any, skip_special: bool = False) -> str:
        out = []
        for i in _as_id_list(ids):
            s = self._id_to_str.get(i)  # ids outside the vocabulary are dropped, as the `tokenizers` backend does
            if s is None or (skip_special and i < len(CHAR_SPECIALS)):
                continue
            out.append(s)
        return "".join(out)

    @classmethod
    def load(cls, folder: str | Path) -> "CharTokenizer":
        """Read a folder written by `save` (the alphabet is taken from tokenizer_config.json)."""
        folder = Path(folder)
        cfg = read_json_file(folder / "tokenizer_config.json")
        if cfg.get("lightningrl_tokenizer") != _CHAR_KIND or not isinstance(cfg.get("alphabet"), str):
            raise ValueError(f"{folder} does not hold a CharTokenizer (tokenizer_config.json lacks its alphabet)")
        tok = cls(cfg["alphabet"])
        saved = folder / "tokenizer.json"
        if saved.is_file():  # the saved vocabulary must agree with the alphabet
            model = read_json_file(saved).get("model")
            vocab = model.get("vocab") if isinstance(model, dict) else None
            if vocab != tok.backend.get_vocab(with_added_tokens=False):
                raise ValueError(f"{saved} does not match the alphabet of {folder / 'tokenizer_config.json'}")
        return tok


# ------------------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------------------

def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint folder (or of a tokenizer.json file); see the module docstring."""
    path = Path(path)
    if path.is_file() and path.name.endswith(".json"):
        folder, tokenizer_file = path.parent, path
    elif path.is_dir():
        folder, tokenizer_file = path, path / "tokenizer.json"
    else:
        raise FileNotFoundError(f"no tokenizer folder or tokenizer.json at {path}")
    config = read_json_file(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    if config.get("lightningrl_tokenizer") == _CHAR_KIND:
        return CharTokenizer.load(folder)
    if tokenizer_file.is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust error says what is wrong; add which file
            raise ValueError(f"cannot read {tokenizer_file}: {e}") from None
    else:
        backend = build_qwen2_bpe(folder, config)

    eos_tokens = [_token_content(config.get("eos_token")), IM_END, ENDOFTEXT]
    eos_ids: list[int] = []
    gen = folder / "generation_config.json"
    if gen.is_file():
        e = read_json_file(gen).get("eos_token_id")
        eos_ids = [] if e is None else _token_ids(e, f"{gen}: eos_token_id")
    pad = _token_content(config.get("pad_token"))
    if pad is None and backend.token_to_id(ENDOFTEXT) is not None:
        pad = ENDOFTEXT
    mask = _token_content(config.get("mask_token"))
    mask_id = None
    if mask is None:
        model_cfg = folder / "config.json"
        if model_cfg.is_file():
            mask_id = read_json_file(model_cfg).get("mask_token_id")
            if mask_id is not None and not _is_id(mask_id):
                raise ValueError(f"{model_cfg}: mask_token_id must be a non-negative integer, got {mask_id!r}")
        if mask_id is None:
            mask = next((m for m in (MASK, "<MASK>") if backend.token_to_id(m) is not None), None)
    # the EOS ids generation_config.json names must be tokens of this tokenizer: a Qwen2 folder copied without its
    # added-token files (tokenizer_config.json's added_tokens_decoder, added_tokens.json) builds a BPE with no
    # special tokens, which would encode <|im_start|> / <|im_end|> as plain text while decoding stops on ids it never
    # produces (the model's mask_token_id is fed to the model only, never encoded or decoded: not checked here)
    unknown = [i for i in eos_ids if backend.id_to_token(i) is None]
    if unknown:
        raise ValueError(f"{folder}: generation_config.json eos_token_id {unknown[0]} is not a token of the tokenizer "
                         f"(vocabulary {backend.get_vocab_size(with_added_tokens=True)}): its special tokens are "
                         "missing (a tokenizer.json, or tokenizer_config.json with added_tokens_decoder / "
                         "added_tokens.json, must come with vocab.json and merges.txt)")
    return Tokenizer(backend, eos_tokens=[t for t in eos_tokens if t], pad_token=pad, mask_token=mask,
                     mask_token_id=mask_id, eos_ids=eos_ids, config=config, source_dir=folder)
