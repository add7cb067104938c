"""Tests for lightningrl_fast/tokenizer.py: the SDAR (Qwen2 BPE) tokenizer rebuilt from vocab.json + merges.txt,
the char-level tokenizer of the synthetic tasks, and the ChatML template.

The Qwen2 rebuild is checked three ways: known ids ("What is 2+3?"), round trips over awkward text, and an
independent pure-Python byte-level BPE (regex split + merge ranks, what the slow Qwen2 tokenizer does) that
must give the same ids on every test string.
"""

from __future__ import annotations

import json
import unicodedata
from functools import lru_cache
from pathlib import Path

import pytest
import tokenizers

from lightningrl_fast.tokenizer import (
    CHAR_SPECIALS,
    DEFAULT_ALPHABET,
    CharTokenizer,
    Tokenizer,
    chat_prompt,
    load_tokenizer,
)

SDAR4B = Path("/work/shared/sdar-meta/SDAR-4B-Chat")
needs_sdar = pytest.mark.skipif(not (SDAR4B / "vocab.json").is_file(), reason="SDAR-4B-Chat tokenizer files absent")

ROUND_TRIP = [
    "What is 2+3?",
    "12345",
    "Hello, world! It's a test; they'll say we've done it.",
    "  leading spaces and trailing   ",
    "line one\nline two\r\n\n\nthree\n",
    "def f(x):\n    if x > 0:\n        return x * 2\n\treturn -x\n",
    "unicode: héllo naïve café Ωmega 世界 こんにちは 🙂👍🏽 Добрый день",
    "math: $\\frac{1}{2} + \\sqrt{x^2}$ = 0.5, \\boxed{42}",
    "<|im_start|>user\nWhat is 7*8?<|im_end|>\n<|im_start|>assistant\n",
    "masked <|MASK|><|MASK|> tokens and <|endoftext|> inside",
    "tabs\tand\u00a0nbsp and emoji 🧪 and \u0301combining",
    "MR. O'TOOLE'S DON'T, I'MA WE'LL they'RE You'D",  # upper-case contractions: the split is case-insensitive
    "cafe\u0301 vs caf\u00e9, A\u030angstr\u00f6m",  # decomposed: NFC composes them before the BPE
    "x=123456789; y = 3.14159\n\n  \n\tz",
    "",
]

# The Qwen2 pre-tokenization regex, written out here (from Qwen2's tokenizer.json `Split` pattern) so that the
# reference below does not share the package's constant.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@pytest.fixture(scope="module")
def sdar_tok() -> Tokenizer:
    return load_tokenizer(SDAR4B)


@needs_sdar
def test_a_qwen2_folder_without_its_added_tokens_is_refused(tmp_path):
    """Was silent: vocab.json + merges.txt without tokenizer_config.json / added_tokens.json built a BPE with no
    special tokens (ChatML markers encoded as plain text) while generation stopped on ids 151643 / 151645, which it
    never produced. Now the ids the folder's configs name must be tokens."""
    import shutil

    for name in ("vocab.json", "merges.txt", "config.json", "generation_config.json"):
        shutil.copy(SDAR4B / name, tmp_path / name)
    with pytest.raises(ValueError, match=r"generation_config.json eos_token_id 1516\d\d is not a token of the "
                                         r"tokenizer \(vocabulary 151643\): its special tokens are missing"):
        load_tokenizer(tmp_path)
    shutil.copy(SDAR4B / "added_tokens.json", tmp_path / "added_tokens.json")
    tok = load_tokenizer(tmp_path)  # with its added tokens: complete
    assert tok.token_to_id("<|im_end|>") == 151645 and tok.mask_token_id == 151669
    # the model's mask_token_id is the model's business (fed to it, never encoded): any id of the embedding
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "mask_token_id": 151935}))
    assert load_tokenizer(tmp_path).mask_token_id == 151935


# --- an independent reference: the byte-level BPE of the slow Qwen2 tokenizer -----------------------------------

@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class _ReferenceBPE:
    def __init__(self, folder: Path) -> None:
        import regex

        self.vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
        self.ranks = {tuple(line.split(" ")): r for r, line in enumerate(l for l in lines[1:] if l)}
        self.split = regex.compile(QWEN2_SPLIT)
        cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        self.added = {t["content"]: int(i) for i, t in cfg["added_tokens_decoder"].items()}
        self.special_re = regex.compile("(" + "|".join(regex.escape(t) for t in sorted(self.added, key=len, reverse=True)) + ")")

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 60), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 60:
                break
            a, b = parts[i], parts[i + 1]
            merged, j = [], 0
            while j < len(parts):  # merge every occurrence of the pair, left to right
                if j < len(parts) - 1 and parts[j] == a and parts[j + 1] == b:
                    merged.append(a + b)
                    j += 2
                else:
                    merged.append(parts[j])
                    j += 1
            parts = merged
        return parts

    def encode(self, text: str) -> list[int]:
        table = _bytes_to_unicode()
        ids = []
        for piece in self.special_re.split(text):
            if piece in self.added:
                ids.append(self.added[piece])
                continue
            for word in self.split.findall(unicodedata.normalize("NFC", piece)):
                mapped = "".join(table[b] for b in word.encode("utf-8"))
                ids.extend(self.vocab[t] for t in self._bpe(mapped))
        return ids


# --- SDAR / Qwen2 -----------------------------------------------------------------------------------------------

@needs_sdar
def test_known_ids(sdar_tok):
    assert sdar_tok.encode("What is 2+3?") == [3838, 374, 220, 17, 10, 18, 30]
    assert sdar_tok.encode("Hello, world!") == [9707, 11, 1879, 0]
    # byte-level BPE on non-ASCII text: ids of the byte-mapped strings in vocab.json ("世界" = 'ä¸ĸçķĮ',
    # " café" = 'ĠcafÃ©', "🙂" = 'ðŁĻĤ'); a decomposed "e + U+0301" is composed (NFC) first
    assert sdar_tok.encode("世界") == [99489] and sdar_tok.encode(" 世界") == [220, 99489]
    assert sdar_tok.encode(" café") == [51950] == sdar_tok.encode(" cafe\u0301")
    assert sdar_tok.encode("🙂") == [145080] and sdar_tok.encode("naïve") == [3376, 37572, 586]
    assert sdar_tok.encode(" Добрый") == [38803, 131014, 34623] and sdar_tok.encode("\n\n") == [271]
    assert sdar_tok.encode("<|im_start|>user\n") == [151644, 872, 198]
    # added_tokens.json also lists "<MASK>" at 151669; tokenizer_config.json's "<|MASK|>" owns that id, and
    # "<MASK>" stays ordinary text (the transformers rule)
    assert 151669 not in sdar_tok.encode("<MASK>") and sdar_tok.decode(sdar_tok.encode("<MASK>")) == "<MASK>"
    assert sdar_tok.mask_token_id == 151669
    assert sdar_tok.special_id("<|MASK|>") == 151669
    assert sdar_tok.special_id("<|im_end|>") == 151645
    assert sdar_tok.special_id("<|endoftext|>") == 151643
    assert sdar_tok.special_id("<|im_start|>") == 151644
    assert sdar_tok.im_start_id == 151644 and sdar_tok.im_end_id == 151645
    assert sdar_tok.eos_token_ids == {151643, 151645}
    assert sdar_tok.pad_token_id == 151643
    assert sdar_tok.vocab_size == 151670
    with pytest.raises(KeyError, match="<nope>"):
        sdar_tok.special_id("<nope>")


@needs_sdar
@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(sdar_tok, text):
    ids = sdar_tok.encode(text)
    assert sdar_tok.decode(ids) == unicodedata.normalize("NFC", text)


@needs_sdar
def test_matches_reference_bpe(sdar_tok):
    ref = _ReferenceBPE(SDAR4B)
    for text in ROUND_TRIP:
        assert sdar_tok.encode(text) == ref.encode(text), text


@needs_sdar
def test_digits_split_and_specials_are_single_ids(sdar_tok):
    ids = sdar_tok.encode("12345")
    assert len(ids) == 5 and [sdar_tok.decode([i]) for i in ids] == list("12345")
    ids = sdar_tok.encode("a<|im_end|>b<|MASK|>")
    assert 151645 in ids and 151669 in ids
    assert sdar_tok.encode("<|im_end|>") == [151645]
    assert sdar_tok.encode(chat_prompt("hi"))[0] == 151644
    # indentation: runs of spaces are kept as whitespace tokens, never merged with the newline before them
    code = "if x:\n    y = 1\n"
    assert sdar_tok.decode(sdar_tok.encode(code)) == code


@needs_sdar
def test_decode_skip_special_and_tensor_input(sdar_tok):
    import torch

    ids = sdar_tok.encode("<|im_start|>assistant\n5<|im_end|><|endoftext|>")
    assert sdar_tok.decode(ids, skip_special=True) == "assistant\n5"
    assert sdar_tok.decode(torch.tensor(ids)) == sdar_tok.decode(ids)
    # SDAR declares <|MASK|> special=False: kept by skip_special, as the real tokenizer does
    assert sdar_tok.decode([151669], skip_special=True) == "<|MASK|>"
    assert sdar_tok.decode([3838, 151900, 374]) == "What is"  # padded-vocab ids (>= 151670) are dropped
    assert sdar_tok.encode_batch(["12", "What is 2+3?"]) == [[16, 17], [3838, 374, 220, 17, 10, 18, 30]]


@needs_sdar
def test_save_reload_as_tokenizer_json(sdar_tok, tmp_path):
    sdar_tok.save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "tokenizer_config.json").is_file()
    spec = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == QWEN2_SPLIT
    assert spec["normalizer"]["type"] == "NFC"
    again = load_tokenizer(tmp_path)  # now through tokenizer.json
    for text in ROUND_TRIP:
        assert again.encode(text) == sdar_tok.encode(text)
    assert again.eos_token_ids == sdar_tok.eos_token_ids
    assert again.mask_token_id == 151669 and again.pad_token_id == 151643
    assert load_tokenizer(tmp_path / "tokenizer.json").encode("What is 2+3?") == [3838, 374, 220, 17, 10, 18, 30]


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="vocab.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)



def _bpe_folder(tmp_path: Path, **files) -> Path:
    """A tiny vocab.json + merges.txt tokenizer folder; `files` replace or add files (name -> text or bytes)."""
    vocab = {c: i for i, c in enumerate("abcĠ")}
    vocab["ab"] = 4
    base = {"vocab.json": json.dumps(vocab), "merges.txt": "#version: 0.2\na b\n",
            "tokenizer_config.json": json.dumps({"added_tokens_decoder": {"5": {"content": "<|endoftext|>", "special": True}}})}
    for name, content in {**base, **files}.items():
        name = name.replace("__", ".")
        if isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        else:
            (tmp_path / name).write_text(content, encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("files, named", [
    ({"tokenizer_config__json": "[]"}, "tokenizer_config.json must hold a JSON object, got list"),
    ({"vocab__json": "[1, 2]"}, "vocab.json must hold a JSON object, got list"),
    ({"vocab__json": json.dumps({"a": 0, "b": "1", "c": 2, "Ġ": 3, "ab": 4})}, "vocab.json: token ids must be non-negative integers"),
    ({"vocab__json": b"\xff\xfe{}"}, "vocab.json is not UTF-8 text"),
    ({"merges__txt": "#version: 0.2\na b\nzz qq\n"}, "do not form a BPE model"),
    ({"merges__txt": b"#version: 0.2\na b\n\xff b\n"}, "merges.txt:3: not UTF-8 text"),
    ({"tokenizer_config__json": json.dumps({"added_tokens_decoder": {"x": {"content": "<x>"}}})}, "key 'x' is not a token id"),
    ({"tokenizer_config__json": json.dumps({"added_tokens_decoder": {"9": {"special": True}}})}, "non-empty string \"content\""),
    ({"tokenizer_config__json": json.dumps({"added_tokens_decoder": {"9": "<x>"}})}, "non-empty string \"content\""),
    ({"tokenizer_config__json": json.dumps({"added_tokens_decoder": {"9": {"content": "<x>", "special": "no"}}})},
     "special must be true or false"),
    ({"added_tokens__json": "[1]"}, "added_tokens.json must hold a JSON object"),
    ({"added_tokens__json": json.dumps({"<y>": "zz"})}, "added_tokens.json: the id of '<y>' must be a non-negative integer"),
    ({"generation_config__json": "[]"}, "generation_config.json must hold a JSON object"),
    ({"generation_config__json": json.dumps({"eos_token_id": 1.5})}, "eos_token_id must be a non-negative integer token id"),
    ({"generation_config__json": json.dumps({"eos_token_id": ["5"]})}, "eos_token_id must be a non-negative integer token id"),
    ({"config__json": json.dumps({"mask_token_id": "7"})}, "config.json: mask_token_id must be a non-negative integer"),
])
def test_malformed_tokenizer_files_are_named(tmp_path, files, named):
    """Each of these was an AttributeError / TypeError / KeyError / the Rust `Exception` (a traceback through the
    CLIs, which report OSError / ValueError / KeyError), or a UnicodeDecodeError that did not name the file."""
    with pytest.raises(ValueError) as e:
        load_tokenizer(_bpe_folder(tmp_path, **files))
    assert named in str(e.value)


def test_char_tokenizer_json_of_the_wrong_shape_is_named(tmp_path):
    CharTokenizer().save(tmp_path)
    (tmp_path / "tokenizer.json").write_text("[]")
    with pytest.raises(ValueError, match="tokenizer.json must hold a JSON object"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": []}')
    with pytest.raises(ValueError, match="does not match the alphabet"):
        load_tokenizer(tmp_path)

def test_gapped_added_token_ids(tmp_path):
    """Added tokens that do not continue the base vocabulary still get their declared ids."""
    vocab = {c: i for i, c in enumerate("abcĠ")}
    vocab["ab"] = 4
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        "9": {"content": "<|endoftext|>", "special": True}, "12": {"content": "<|MASK|>", "special": False}}}))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("abc<|MASK|>ab <|endoftext|>") == [4, 2, 12, 4, 3, 9]
    assert tok.mask_token_id == 12 and tok.eos_token_ids == {9} and tok.pad_token_id == 9


def _tokens_folder(tmp_path: Path, added: dict[int, tuple[str, bool]], config: dict | None = None,
                   **files) -> Path:
    """A tiny vocab.json + merges.txt folder whose added tokens (id -> (content, special)) are declared in
    tokenizer_config.json; `config` adds keys to that file, `files` adds files (name -> JSON-able object)."""
    vocab = {c: i for i, c in enumerate("abcĠ")}
    vocab["ab"] = 4
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    decl = {str(i): {"content": c, "special": sp} for i, (c, sp) in added.items()}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decl, **(config or {})}))
    for name, obj in files.items():
        (tmp_path / name.replace("__", ".")).write_text(json.dumps(obj))
    return tmp_path


def test_special_ids_follow_the_documented_precedence(tmp_path):
    """eos = the config's eos_token + <|im_end|> + <|endoftext|> + generation_config's eos_token_id; pad =
    pad_token, else <|endoftext|> (even when another eos has a smaller id); mask = mask_token, else
    config.json's mask_token_id, else <|MASK|> before <MASK>."""
    added = {5: ("<|im_end|>", True), 6: ("<|endoftext|>", True), 7: ("<MASK>", True), 8: ("<|MASK|>", False)}
    tok = load_tokenizer(_tokens_folder(tmp_path / "a", added, generation_config__json={"eos_token_id": 3}))
    assert tok.eos_token_ids == {3, 5, 6}  # 3 ('Ġ') only from generation_config.json
    assert tok.pad_token_id == 6  # <|endoftext|>, not min(eos)
    assert tok.mask_token_id == 8  # <|MASK|> before the legacy <MASK>
    tok = load_tokenizer(_tokens_folder(tmp_path / "b", added, {"mask_token": "<|MASK|>"},
                                        config__json={"mask_token_id": 7}))
    assert tok.mask_token_id == 8  # the tokenizer's own mask_token beats config.json
    assert load_tokenizer(_tokens_folder(tmp_path / "c", added, config__json={"mask_token_id": 7})).mask_token_id == 7


def test_legacy_added_tokens_json_follows_the_transformers_rule(tmp_path):
    """added_tokens.json adds only tokens whose id AND content tokenizer_config.json does not declare: a content
    declared at another id stays at that id (no duplicate token, no id-mismatch error)."""
    folder = _tokens_folder(tmp_path, {5: ("<|endoftext|>", True)},
                            added_tokens__json={"<|endoftext|>": 6, "<extra>": 7})
    tok = load_tokenizer(folder)
    assert tok.token_to_id("<|endoftext|>") == 5 and tok.encode("<|endoftext|>") == [5]
    assert tok.special_tokens == {"<|endoftext|>": 5, "<extra>": 7}
    assert tok.decode([4, 7, 5], skip_special=True) == "ab"  # legacy tokens count as special


@needs_sdar
def test_sdar_added_tokens_stay_out_of_the_bpe_vocabulary(sdar_tok, tmp_path):
    """SDAR's added tokens continue vocab.json's ids (151643..151669): as in the real tokenizer.json, they are
    added tokens only, not entries of the BPE model's vocabulary (151643 entries)."""
    n_base = len(json.loads((SDAR4B / "vocab.json").read_text(encoding="utf-8")))
    assert n_base == 151643
    assert sdar_tok.backend.get_vocab_size(with_added_tokens=False) == n_base
    sdar_tok.save(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert len(spec["model"]["vocab"]) == n_base and "<|im_end|>" not in spec["model"]["vocab"]
    assert {t["id"] for t in spec["added_tokens"]} == set(range(151643, 151670))


def test_encode_never_adds_a_bos(tmp_path):
    """A tokenizer.json whose post-processor would add a BOS: encode still returns the text's ids alone."""
    from tokenizers import processors

    backend = CharTokenizer("ab").backend
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                           special_tokens=[("<|im_start|>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert backend.encode("ab").ids == [1, 4, 5]  # what the post-processor does when asked
    assert tok.encode("ab") == [4, 5] and tok.encode_batch(["ba"]) == [[5, 4]]


def test_saved_config_declares_no_bos(tmp_path):
    """The saved tokenizer_config.json says no BOS (add_bos_token false, bos_token null), as SDAR's does, also for
    a tokenizer whose own config did not say it."""
    CharTokenizer().save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["add_bos_token"] is False and cfg["bos_token"] is None


# --- char tokenizer ---------------------------------------------------------------------------------------------

def test_char_ids_and_round_trip():
    tok = CharTokenizer()
    assert [tok.special_id(t) for t in CHAR_SPECIALS] == [0, 1, 2, 3]
    assert tok.mask_token_id == 3 and tok.eos_token_ids == {0, 2} and tok.pad_token_id == 0
    assert tok.vocab_size == 4 + len(DEFAULT_ALPHABET)
    text = "6+4=10,10+5=15#15"
    ids = tok.encode(text)
    assert ids == [4 + DEFAULT_ALPHABET.index(c) for c in text]
    assert tok.decode(ids) == text
    prompt = chat_prompt("3*(2-1)=?")
    ids = tok.encode(prompt + "3<|im_end|><|MASK|>")
    assert ids[0] == 1 and ids[-2:] == [2, 3]
    assert tok.decode(ids) == prompt + "3<|im_end|><|MASK|>"
    assert tok.decode(ids, skip_special=True) == "user\n3*(2-1)=?\nassistant\n3"
    # skip_special drops the four specials only: id 4 is the alphabet's first character
    assert tok.decode([0, 4, 1, 2, 3, 5], skip_special=True) == DEFAULT_ALPHABET[:2]


def test_char_unknown_character_error():
    tok = CharTokenizer("0123456789+=")
    with pytest.raises(ValueError, match=r"'x'.*position 2"):
        tok.encode("1+x")
    assert tok.decode([5, 99, 6]) == "12"  # ids beyond the vocabulary (a padded model vocab) are dropped
    with pytest.raises(ValueError, match="repeats"):
        CharTokenizer("112")


def test_char_save_load_is_a_real_tokenizer_json(tmp_path):
    tok = CharTokenizer("0123456789+-=#, \n")
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, CharTokenizer) and again.alphabet == tok.alphabet
    plain = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in ["6+4=10,10+5=15#15", "1 2\n3", "<|im_start|>12<|im_end|><|MASK|><|endoftext|>", ""]:
        assert plain.encode(text, add_special_tokens=False).ids == tok.encode(text) == again.encode(text)
        assert plain.decode(tok.encode(text), skip_special_tokens=False) == text
    assert plain.get_vocab_size() == tok.vocab_size


def test_chat_prompt():
    assert chat_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat_prompt("hi", system="be brief") == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
