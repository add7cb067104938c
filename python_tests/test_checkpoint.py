"""Tests for lightningrl_fast/checkpoint.py: save/load round trips (single file, sharded, bf16/fp32, tied),
the real SDAR-4B/8B parameter layout (from config.json + the real index, no weights), config round trips,
readable errors for broken folders, and atomic saves that survive a crash or a kill mid-save.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lightningrl_fast import checkpoint as ckpt
from lightningrl_fast.checkpoint import CheckpointError, load_model, read_config, save_model
from lightningrl_fast.model import SDARConfig, SDARForCausalLM

# TINY's config names a remote-code module that its tests do not provide: save_model's warning is expected
pytestmark = pytest.mark.filterwarnings("ignore:.*auto_map names")

META = Path("/work/shared/sdar-meta")
REPO = Path(__file__).resolve().parents[1]

TINY = dict(vocab_size=111, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
            tie_word_embeddings=False, torch_dtype="float32", block_size=4, mask_token_id=110,
            auto_map={"AutoConfig": "configuration_sdar.SDARConfig"}, fuse_cross_entropy=True)


def tiny_model(dtype=torch.float32, tied=False, seed=0):
    cfg = SDARConfig.from_dict({**TINY, "tie_word_embeddings": tied, "torch_dtype": str(dtype).removeprefix("torch.")})
    torch.manual_seed(seed)
    model = SDARForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    return model.to(dtype).eval(), cfg


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(sa[k], sb[k]), k


def sdar_names(n_layers: int, tied: bool = False) -> list[str]:
    """The tensor names of a real SDAR checkpoint with `n_layers` layers: those of the SDAR-4B index (read from
    /work/shared/sdar-meta when present, else written out) for its layers below `n_layers`."""
    index = META / "SDAR-4B-Chat" / "model.safetensors.index.json"
    if index.is_file():
        real = json.loads(index.read_text())["weight_map"]
    else:
        per_layer = ["input_layernorm", "post_attention_layernorm", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj",
                     *(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"))]
        real = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                *(f"model.layers.{i}.{p}.weight" for i in range(36) for p in per_layer)]
    keep = [n for n in real if not n.startswith("model.layers.") or int(n.split(".")[2]) < n_layers]
    return sorted(n for n in keep if not (tied and n == "lm_head.weight"))


def _stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved folder, read straight from its safetensors files (no name may repeat)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as g:
            for k in g.keys():
                assert k not in out, f"{k} stored twice"
                out[k] = g.get_tensor(k)
    return out


def logits(model, seed=1):
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids)


# --- round trips ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, 20_000])
def test_round_trip(tmp_path, dtype, max_shard_bytes):
    model, cfg = tiny_model(dtype)
    out = save_model(model, cfg, tmp_path / "ck", max_shard_bytes=max_shard_bytes)
    files = sorted(p.name for p in out.iterdir())
    if max_shard_bytes > 2**20:
        assert files == ["config.json", "model.safetensors"]
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:  # transformers refuses other formats
            assert f.metadata() == {"format": "pt"}
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        assert set(index["weight_map"]) == set(model.state_dict())
        assert list(index["weight_map"]) == sorted(index["weight_map"])  # the HF writers' order
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        assert index["metadata"]["total_size"] == nbytes
        for s in shards:
            with safe_open(str(out / s), framework="pt") as f:
                assert f.metadata() == {"format": "pt"}
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert config["model_type"] == "sdar" and config["architectures"] == ["SDARForCausalLM"]
    # the files themselves (read here, not through load_model): the real SDAR names, each tensor once, stored in
    # the model's dtype with its exact values, and the config keys SDAR's config.json uses
    assert sorted(_stored_tensors(out)) == sdar_names(cfg.num_hidden_layers)
    for name, t in _stored_tensors(out).items():
        assert t.dtype == dtype and torch.equal(t, model.state_dict()[name]), name
    for key, value in TINY.items():
        assert config[key] == (str(dtype).removeprefix("torch.") if key == "torch_dtype" else value), key
    loaded, cfg2 = load_model(out)
    assert cfg2.to_dict() == cfg.to_dict()
    assert_same_state(model, loaded)
    assert not loaded.training
    assert torch.equal(logits(model), logits(loaded))


def test_config_written_from_a_plain_dict(tmp_path):
    """A dict config (a Qwen3-style config.json, say) is written as SDAR's: model_type "sdar", architectures
    ["SDARForCausalLM"], torch_dtype the weights' dtype (the dtype most of the weights have, here bfloat16 with
    float32 norms), its other keys kept."""
    model, cfg = tiny_model(torch.bfloat16)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data = p.data.float()
    d = {k: v for k, v in cfg.to_dict().items() if k not in ("model_type", "architectures")}
    out = save_model(model, d | {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "my_key": 7},
                     tmp_path / "ck")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "sdar" and written["architectures"] == ["SDARForCausalLM"]
    assert written["torch_dtype"] == "bfloat16" and written["my_key"] == 7
    out = save_model(model, d, tmp_path / "bare")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "sdar" and written["architectures"] == ["SDARForCausalLM"]
    assert "dtype" not in written
    # a config.json of newer transformers names the dtype `dtype` (which transformers prefers over torch_dtype):
    # was written back stale ("float32" beside torch_dtype "bfloat16"; transformers reads `dtype` first)
    out = save_model(model, d | {"dtype": "float32"}, tmp_path / "new-hf")
    written = json.loads((out / "config.json").read_text())
    assert written["torch_dtype"] == "bfloat16" and written["dtype"] == "bfloat16"
    assert read_config(out).dtype == torch.bfloat16


def test_dtype_override(tmp_path):
    model, cfg = tiny_model(torch.float32)
    save_model(model, cfg, tmp_path / "ck")
    loaded, _ = load_model(tmp_path / "ck", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.bfloat16())


@pytest.mark.parametrize("with_lm_head", [False, True])
def test_tied_embeddings(tmp_path, with_lm_head):
    model, cfg = tiny_model(tied=True)
    out = save_model(model, cfg, tmp_path / "ck", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    stored = _stored_tensors(out)
    assert sorted(stored) == sdar_names(cfg.num_hidden_layers, tied=True)
    assert torch.equal(stored["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    if with_lm_head:  # a tied checkpoint that also stores lm_head.weight (equal) loads without complaint
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        (out / "model.safetensors.index.json").unlink()
        for s in out.glob("model-*.safetensors"):
            s.unlink()
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    loaded, _ = load_model(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert not loaded.lm_head.weight.is_meta
    assert torch.equal(logits(model), logits(loaded))


def test_tied_checkpoint_with_different_lm_head_warns(tmp_path):
    model, cfg = tiny_model(tied=True)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["lm_head.weight"] += 1.0
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.warns(UserWarning, match="lm_head.weight differs"):
        loaded, _ = load_model(tmp_path)
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)


def test_save_with_tokenizer(tmp_path):
    from lightningrl_fast.tokenizer import CharTokenizer, load_tokenizer

    model, cfg = tiny_model()
    out = save_model(model, cfg, tmp_path / "ck", tokenizer=CharTokenizer("0123456789+="))
    assert load_tokenizer(out).encode("1+2=3") == [5, 14, 6, 15, 7]
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "generation_config.json").write_text('{"eos_token_id": [1, 2]}')
    out2 = save_model(model, cfg, tmp_path / "ck2", tokenizer=tok_dir)
    assert (out2 / "generation_config.json").is_file()
    with pytest.raises(FileNotFoundError):
        save_model(model, cfg, tmp_path / "ck3", tokenizer=tmp_path / "nowhere")
    assert not (tmp_path / "ck3").exists()
    empty = tmp_path / "no-tokenizer-files"  # a folder, but none of a tokenizer's files: not a tokenizer
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="holds none of the tokenizer files"):
        save_model(model, cfg, tmp_path / "ck4", tokenizer=empty)
    assert not (tmp_path / "ck4").exists()


@pytest.mark.skipif(not (META / "SDAR-4B-Chat" / "vocab.json").is_file(), reason="sdar-meta tokenizer files absent")
def test_saved_folder_carries_the_remote_code_and_slow_tokenizer_files(tmp_path):
    """What transformers' trust_remote_code loading of a saved folder reads: the modules config.json's and
    tokenizer_config.json's auto_map name (copied from the source checkpoint, whatever else it imports too) and
    the slow Qwen2Tokenizer's vocab.json / merges.txt / added_tokens.json."""
    import shutil

    from lightningrl_fast.tokenizer import load_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    for f in (META / "SDAR-4B-Chat").iterdir():
        if f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copyfile(f, src / f.name)
    code = {"configuration_sdar.py": "# config\n", "modeling_sdar.py": "from .fused import x\n",
            "fused.py": "x = 1\n", "tokenization_qwen2.py": "# tokenizer\n"}
    for name, text in code.items():
        (src / name).write_text(text)
    model, cfg = tiny_model()
    assert ckpt.auto_map_modules({"auto_map": {"AutoConfig": "configuration_sdar.SDARConfig",
                                               "AutoModel": "modeling_sdar.SDARModel",
                                               "AutoTokenizer": ["tokenization_qwen2.Qwen2Tokenizer", None]}}) == [
        "configuration_sdar.py", "modeling_sdar.py", "tokenization_qwen2.py"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing missing: no warning
        out = save_model(model, cfg, tmp_path / "out", tokenizer=load_tokenizer(src))
    for name, text in code.items():
        assert (out / name).read_text() == text, name
    for name in ("vocab.json", "merges.txt", "added_tokens.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert (out / "vocab.json").read_bytes() == (src / "vocab.json").read_bytes()
    # a re-save of the saved folder (the next RL checkpoint) keeps them: its tokenizer's source is that folder
    again = save_model(model, cfg, tmp_path / "again", tokenizer=load_tokenizer(out))
    assert all((again / name).is_file() for name in code)
    # an explicit code_dir, and a folder whose auto_map modules cannot be found: a warning names them
    bare = save_model(model, cfg, tmp_path / "bare", code_dir=src)
    assert (bare / "configuration_sdar.py").is_file() and not (bare / "vocab.json").exists()
    with pytest.warns(UserWarning, match="configuration_sdar.py"):
        save_model(model, cfg, tmp_path / "nocode")


@pytest.mark.skipif(not (META / "SDAR-4B-Chat" / "vocab.json").is_file(), reason="sdar-meta tokenizer files absent")
def test_tokenizer_folder_files_are_copied_as_they_are(tmp_path):
    """A tokenizer given as a folder (a real SDAR one): every tokenizer file it holds, chat template and
    generation config included, is copied byte for byte (the chat template is what `--chat` and transformers'
    apply_chat_template read)."""
    src = META / "SDAR-4B-Chat"
    model, cfg = tiny_model()
    out = save_model(model, cfg, tmp_path / "ck", tokenizer=src)
    expected = {"tokenizer_config.json", "vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json",
                "chat_template.jinja", "generation_config.json"}
    assert expected <= {p.name for p in src.iterdir()}
    for name in expected:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert (out / "config.json").read_bytes() != (src / "config.json").read_bytes()  # the model's own config


def test_auto_map_modules_of_real_and_hub_style_references():
    """The real SDAR auto_map names modeling_sdar twice (AutoModel and AutoModelForCausalLM): listed once; a hub
    reference `repo--module.Class` names the module file of that repo."""
    real = {"auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                         "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"}}
    if (META / "SDAR-4B-Chat" / "config.json").is_file():
        assert json.loads((META / "SDAR-4B-Chat" / "config.json").read_text())["auto_map"] == real["auto_map"]
    assert ckpt.auto_map_modules(real) == ["configuration_sdar.py", "modeling_sdar.py"]
    hub = {"auto_map": {"AutoConfig": "JetLM/SDAR-4B-Chat--configuration_sdar.SDARConfig",
                        "AutoTokenizer": ["JetLM/SDAR-4B-Chat--tokenization_qwen2.Qwen2Tokenizer", None]}}
    assert ckpt.auto_map_modules(hub) == ["configuration_sdar.py", "tokenization_qwen2.py"]
    assert ckpt.auto_map_modules({}) == [] and ckpt.auto_map_modules({"auto_map": None}) == []


def test_streams_one_shard_at_a_time(tmp_path, monkeypatch):
    """Each load_state_dict call gets exactly one shard's tensors, already in the target dtype (peak = one shard)."""
    model, cfg = tiny_model()
    out = save_model(model, cfg, tmp_path / "ck", max_shard_bytes=20_000)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    calls = []
    real = torch.nn.Module.load_state_dict

    def spy(self, state_dict, *args, **kwargs):
        calls.append({k: v.dtype for k, v in state_dict.items()})
        return real(self, state_dict, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "load_state_dict", spy)
    load_model(out, dtype=torch.bfloat16)
    shards = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, set()).add(name)
    assert sorted(map(sorted, (set(c) for c in calls))) == sorted(map(sorted, shards.values()))
    assert all(d == torch.bfloat16 for c in calls for d in c.values())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_to_cuda(tmp_path, dtype):
    model, cfg = tiny_model(dtype, tied=dtype == torch.bfloat16)
    out = save_model(model, cfg, tmp_path / "ck", max_shard_bytes=20_000)
    loaded, _ = load_model(out, device="cuda")
    assert all(p.is_cuda and p.dtype == dtype for p in loaded.parameters())
    cpu_state = model.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v.cpu(), cpu_state[k]), k
    save_model(loaded, cfg, tmp_path / "ck2")  # saving from CUDA tensors works too
    assert_same_state(model, load_model(tmp_path / "ck2")[0])


# --- real SDAR layouts (config + index only) --------------------------------------------------------------------

def implied_shape(name: str, c: SDARConfig) -> tuple[int, ...]:
    h, d = c.hidden_size, c.head_dim
    table = {
        "model.embed_tokens.weight": (c.vocab_size, h), "lm_head.weight": (c.vocab_size, h), "model.norm.weight": (h,),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (c.num_attention_heads * d, h), "self_attn.k_proj.weight": (c.num_key_value_heads * d, h),
        "self_attn.v_proj.weight": (c.num_key_value_heads * d, h), "self_attn.o_proj.weight": (h, c.num_attention_heads * d),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (c.intermediate_size, h), "mlp.up_proj.weight": (c.intermediate_size, h),
        "mlp.down_proj.weight": (h, c.intermediate_size),
    }
    if name in table:
        return table[name]
    parts = name.split(".")
    assert parts[:2] == ["model", "layers"] and 0 <= int(parts[2]) < c.num_hidden_layers, name
    return table[".".join(parts[3:])]


@pytest.mark.parametrize("size", ["SDAR-4B-Chat", "SDAR-8B-Chat"])
def test_real_parameter_names_and_shapes(size):
    folder = META / size
    if not (folder / "config.json").is_file():
        pytest.skip(f"{folder} absent")
    cfg = read_config(folder)
    with torch.device("meta"):
        model = SDARForCausalLM(cfg)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    params = dict(model.named_parameters())
    assert set(params) == set(index["weight_map"])
    for name, p in params.items():
        assert tuple(p.shape) == implied_shape(name, cfg), name
    total = sum(p.numel() for p in params.values()) * 2  # bf16
    assert total == index["metadata"]["total_size"]
    # the loader's own validation agrees with the real layout (shapes as the headers would give them)
    ckpt._validate(model, {n: implied_shape(n, cfg) for n in index["weight_map"]}, folder)


@pytest.mark.parametrize("size", ["SDAR-4B-Chat", "SDAR-8B-Chat"])
def test_real_config_round_trip(tmp_path, size):
    src = META / size / "config.json"
    if not src.is_file():
        pytest.skip(f"{src} absent")
    original = json.loads(src.read_text())
    cfg = read_config(src)
    assert cfg.block_size == 4 and cfg.mask_token_id == 151669 and cfg.head_dim == 128
    model, _ = tiny_model()  # weights do not matter here: write the real config with a tiny model's files
    tiny_cfg = {**original, **{k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                                  "head_dim", "mask_token_id")}, "torch_dtype": "float32"}
    save_model(model, tiny_cfg, tmp_path / "ck")
    written = json.loads((tmp_path / "ck" / "config.json").read_text())
    for key, value in original.items():
        if key not in tiny_cfg or tiny_cfg[key] == value:
            assert written[key] == value, key
    assert written["auto_map"] == original["auto_map"] and written["fuse_cross_entropy"] is True
    again = read_config(tmp_path / "ck")
    assert again.to_dict()["auto_map"] == original["auto_map"]
    assert load_model(tmp_path / "ck")[1].extra["fuse_cross_entropy"] is True
    # through SDARConfig (what training saves): the written config.json is the real one, key for key and value
    # for value (torch_dtype aside: the tiny model's weights are float32); no key dropped, renamed or defaulted
    save_model(model, cfg, tmp_path / "via-config")
    assert json.loads((tmp_path / "via-config" / "config.json").read_text()) == {**original, "torch_dtype": "float32"}


# --- errors -----------------------------------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    model, cfg = tiny_model()
    return save_model(model, cfg, tmp_path / "ck", max_shard_bytes=20_000), model


def test_missing_config_file_and_key(tmp_path, saved):
    folder, _ = saved
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere")
    d = json.loads((folder / "config.json").read_text())
    del d["hidden_size"]
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="'hidden_size'"):
        load_model(folder)
    (folder / "config.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_model(folder)
    # was: the last of two values silently used (block_size 2 instead of 4)
    text = json.dumps(d | {"hidden_size": 64})
    (folder / "config.json").write_text(text[:-1] + ', "block_size": 2}')
    with pytest.raises(CheckpointError, match="config.json is not valid JSON: duplicate key 'block_size'"):
        load_model(folder)


def _rewrite_shard(folder: Path, edit):
    """Apply edit(tensors dict) to the shard holding model.norm.weight."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"]["model.norm.weight"]
    with safe_open(str(shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(shard))
    return index, shard


def test_missing_tensor(saved):
    folder, _ = saved
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        load_model(folder)


def test_tensor_missing_from_its_shard(saved):
    folder, _ = saved
    _rewrite_shard(folder, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match="lacks tensor.*model.norm.weight"):
        load_model(folder)


def test_unexpected_tensor(saved):
    folder, _ = saved

    def add(t):
        t["model.layers.7.extra.weight"] = torch.zeros(3)
        t["model.rotary_emb.inv_freq"] = torch.zeros(8)

    index, shard = _rewrite_shard(folder, add)
    index["weight_map"]["model.layers.7.extra.weight"] = shard.name
    index["weight_map"]["model.rotary_emb.inv_freq"] = shard.name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="unexpected.*model.layers.7.extra.weight, model.rotary_emb.inv_freq"):
        load_model(folder)


def test_wrong_shape(saved):
    folder, _ = saved
    _rewrite_shard(folder, lambda t: t.__setitem__("model.norm.weight", torch.ones(65)))
    with pytest.raises(CheckpointError, match=r"model.norm.weight: the config implies \[64\], the checkpoint has \[65\]"):
        load_model(folder)


def test_nonfinite_weights_are_refused_at_load(saved):
    """Was: a checkpoint with a NaN norm weight loaded; generate wrote an empty text per prompt with rc 0 and eval
    read 0% without a word. A value past the load dtype's range (fp32 -> fp16) counts as inf too."""
    folder, _ = saved

    def poison(t):
        w = t["model.norm.weight"].clone()
        w[3] = float("nan")
        t["model.norm.weight"] = w

    _rewrite_shard(folder, poison)
    with pytest.raises(CheckpointError, match=r"tensor\(s\) model.norm.weight hold NaN or inf"):
        load_model(folder)

    def huge(t):
        w = t["model.norm.weight"].clone()
        w[3] = 1e6  # finite in float32, inf in float16
        t["model.norm.weight"] = w

    _rewrite_shard(folder, huge)
    load_model(folder, dtype=torch.float32)
    with pytest.raises(CheckpointError, match="model.norm.weight hold NaN or inf"):
        load_model(folder, dtype=torch.float16)


def test_wrong_shape_single_file(tmp_path):
    model, cfg = tiny_model()
    out = save_model(model, cfg, tmp_path / "ck")
    sd = dict(model.state_dict())
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"k_proj.weight: the config implies \[32, 64\], the checkpoint has \[16, 64\]"):
        load_model(out)


def test_missing_shard_and_corrupt_index(saved):
    folder, _ = saved
    index_text = (folder / "model.safetensors.index.json").read_text()
    shards = sorted(set(json.loads(index_text)["weight_map"].values()))
    (folder / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match=f"missing shard file.*{shards[-1]}"):
        load_model(folder)
    (folder / "model.safetensors.index.json").write_text(index_text[: len(index_text) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not valid JSON"):
        load_model(folder)
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="weight_map"):
        load_model(folder)


def test_index_naming_files_outside_the_folder_is_refused(saved):
    """A weight_map entry is a file name inside the checkpoint folder: `../x` or an absolute path would read
    weights from elsewhere (another checkpoint) without a word."""
    folder, _ = saved
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = index["weight_map"]["model.norm.weight"]
    outside = folder.parent / name
    outside.write_bytes((folder / name).read_bytes())  # a loadable shard, just not in the folder
    for ref in (f"../{name}", str(outside)):
        (folder / "model.safetensors.index.json").write_text(
            json.dumps(index | {"weight_map": index["weight_map"] | {"model.norm.weight": ref}}))
        with pytest.raises(CheckpointError, match="names shard files outside the folder"):
            load_model(folder)


@pytest.mark.parametrize("weight_map", [{"model.norm.weight": 3}, {"model.norm.weight": None}, ["a", "b"]])
def test_weight_map_of_the_wrong_shape_is_named(saved, weight_map):
    """Was (a number or null as a shard name): a TypeError traceback from pathlib, not the index named."""
    folder, _ = saved
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    wm = weight_map if isinstance(weight_map, list) else index["weight_map"] | weight_map
    (folder / "model.safetensors.index.json").write_text(json.dumps(index | {"weight_map": wm}))
    with pytest.raises(CheckpointError, match="has no valid 'weight_map'"):
        load_model(folder)


def test_tied_checkpoint_with_an_lm_head_of_the_wrong_shape_is_refused(tmp_path):
    """A tied checkpoint that also stores lm_head.weight: a differing value is ignored with a warning, but a
    different SHAPE means the checkpoint is not the model its config describes."""
    model, cfg = tiny_model(tied=True)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["lm_head.weight"] = torch.zeros(cfg.vocab_size - 1, cfg.hidden_size)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"shape mismatch for tied lm_head.weight: expected \[111, 64\], "
                                              r"found \[110, 64\]"):
        load_model(tmp_path)


def test_tied_checkpoint_with_lm_head_alone_in_a_shard(tmp_path):
    """A sharded tied checkpoint whose lm_head.weight copy sits in a shard of its own (nothing of that shard is
    loaded: the tied weight is used) loads like the others."""
    model, cfg = tiny_model(tied=True)
    out = save_model(model, cfg, tmp_path / "ck", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    save_file({"lm_head.weight": model.model.embed_tokens.weight.detach().clone()}, str(out / "lm-head.safetensors"),
              metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = "lm-head.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # equal to the embedding: no warning either
        loaded, _ = load_model(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(logits(model), logits(loaded))


def _shard_sizes(folder: Path) -> list[list[int]]:
    """The byte sizes of the tensors of each shard, shards in file-name order and tensors in model order."""
    order = list(tiny_model()[0].state_dict())
    out = []
    for f in sorted(folder.glob("model-*.safetensors")):
        with safe_open(str(f), framework="pt") as g:
            ts = {k: g.get_tensor(k) for k in g.keys()}
        out.append([ts[k].numel() * ts[k].element_size() for k in sorted(ts, key=order.index)])
    return out


def test_shards_are_filled_greedily_up_to_the_limit(tmp_path):
    """Greedy in model order: a shard is never over the limit (unless it holds a single tensor larger than the
    limit), and the next shard's first tensor would not have fitted into it; a limit of exactly the total size is
    one file."""
    model, cfg = tiny_model()
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    out = save_model(model, cfg, tmp_path / "exact", max_shard_bytes=total)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    limit = 40_000
    sizes = _shard_sizes(save_model(model, cfg, tmp_path / "ck", max_shard_bytes=limit))
    assert sum(map(sum, sizes)) == total and len(sizes) > 2
    for i, shard in enumerate(sizes):
        assert sum(shard) <= limit or len(shard) == 1, (i, shard)
        if i + 1 < len(sizes):
            assert sum(shard) + sizes[i + 1][0] > limit, (i, shard, sizes[i + 1][0])
    # model order: the first shard starts with the embedding (the model's first parameter)
    assert sizes[0][0] == cfg.vocab_size * cfg.hidden_size * 4


def test_no_weights(tmp_path):
    _, cfg = tiny_model()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)



@pytest.mark.parametrize("key, value, named", [
    ("rms_norm_eps", "1e-6", "'rms_norm_eps' must be a positive finite number, got '1e-6'"),
    ("rms_norm_eps", float("nan"), "'rms_norm_eps' must be a positive finite number, got nan"),
    ("rms_norm_eps", -1.0, "'rms_norm_eps' must be a positive finite number"),
    ("rope_theta", "abc", "'rope_theta' must be a positive finite number"),
    ("max_position_embeddings", "256", "'max_position_embeddings' must be a positive integer, got '256'"),
    ("max_position_embeddings", -1, "'max_position_embeddings' must be a positive integer, got -1"),
    ("max_position_embeddings", None, "'max_position_embeddings' must be a positive integer, got None"),
    ("num_hidden_layers", True, "'num_hidden_layers' must be a positive integer, got True"),
    ("mask_token_id", "110", "'mask_token_id' must be int (or null), got '110'"),
    ("tie_word_embeddings", "false", "'tie_word_embeddings' must be bool (or null), got 'false'"),
    ("block_size", "4", "'block_size' must be a positive integer, got '4'"),
    ("num_hidden_layers", 0, "'num_hidden_layers' must be a positive integer, got 0"),
    ("rms_norm_eps", float("inf"), "'rms_norm_eps' must be a positive finite number, got inf"),
    ("rope_theta", float("inf"), "'rope_theta' must be a positive finite number, got inf"),
    ("mask_token_id", True, "'mask_token_id' must be int (or null), got True"),
])
def test_config_values_of_the_wrong_type_are_named(tmp_path, key, value, named):
    """A quoted number, a "false" string, NaN or a bool count was a TypeError deep in the model, an unclear
    comparison error, or (tie_word_embeddings "false", NaN eps) a silently different model."""
    model, cfg = tiny_model()
    folder = save_model(model, cfg, tmp_path / "ck")
    d = json.loads((folder / "config.json").read_text())
    d[key] = value
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="wrong type or range") as e:
        load_model(folder)
    assert named in str(e.value) and "config.json" in str(e.value)


def test_a_checkpoint_folder_whose_name_ends_in_json(tmp_path):
    """A folder named like a file (``run.json``) is a checkpoint folder: its config.json is read, not the folder
    taken for the config file; a config.json path itself still works."""
    model, cfg = tiny_model()
    folder = save_model(model, cfg, tmp_path / "run.json")
    got = read_config(folder)
    assert got == read_config(folder / "config.json") and got.hidden_size == cfg.hidden_size
    assert load_model(folder)[1] == got


def test_model_type_other_than_sdar_warns(tmp_path):
    """A config.json of another architecture (a llama, say) is loaded as SDAR only with a warning naming it; SDAR's
    own type and the Qwen3 it is built on load silently."""
    model, cfg = tiny_model()
    folder = save_model(model, cfg, tmp_path / "ck")
    d = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(d | {"model_type": "llama"}))
    with pytest.warns(UserWarning, match="model_type 'llama' is not 'sdar'"):
        read_config(folder)
    for quiet in ("sdar", "qwen3"):
        (folder / "config.json").write_text(json.dumps(d | {"model_type": quiet}))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            read_config(folder)


def test_real_configs_pass_the_type_checks():
    for size in ("4B", "8B"):
        read_config(META / f"SDAR-{size}-Chat")  # no error


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage"])
def test_corrupt_single_safetensors_file_is_named(tmp_path, damage):
    """A truncated / empty / non-safetensors model.safetensors raised safetensors' own SafetensorError (a
    traceback through the CLIs), not a CheckpointError naming the file."""
    model, cfg = tiny_model()
    folder = save_model(model, cfg, tmp_path / "ck")
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncate": data[: len(data) // 2], "empty": b"", "garbage": b"\x10" + b"\0" * 7 + b"{not json}"}[damage])
    with pytest.raises(CheckpointError, match="cannot read safetensors file .*model.safetensors"):
        load_model(folder)


def test_integer_weight_is_refused(tmp_path):
    """An integer tensor under a float weight's name was silently cast to the load dtype."""
    model, cfg = tiny_model()
    folder = save_model(model, cfg, tmp_path / "ck")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    sd["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight is stored as I32, not a floating-point type"):
        load_model(folder)


def test_non_utf8_config_and_index_are_named(saved):
    folder, _ = saved
    (folder / "model.safetensors.index.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not UTF-8"):
        load_model(folder)
    (folder / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match="config.json is not UTF-8"):
        load_model(folder)

# --- atomic save ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("exchange", [True, False])
def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch, exchange):
    old, cfg = tiny_model(seed=0)
    new, _ = tiny_model(seed=1)
    folder = save_model(old, cfg, tmp_path / "ck", max_shard_bytes=20_000)
    real_write = ckpt._write_shard
    calls = []

    def failing(tensors, file, metadata):
        calls.append(file)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        real_write(tensors, file, metadata)

    monkeypatch.setattr(ckpt, "_write_shard", failing)
    with pytest.raises(OSError, match="simulated"):
        save_model(new, cfg, folder, max_shard_bytes=20_000)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temp folder left behind
    assert_same_state(old, load_model(folder)[0])

    monkeypatch.setattr(ckpt, "_write_shard", real_write)
    if not exchange:
        monkeypatch.setattr(ckpt, "_rename_exchange", lambda a, b: False)
    save_model(new, cfg, folder)  # a later good save replaces it (single file now)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_state(new, load_model(folder)[0])


def test_kill_mid_save_keeps_previous(tmp_path):
    """A process killed halfway (no cleanup runs) leaves the old checkpoint; the next save cleans up."""
    old, cfg = tiny_model(seed=0)
    folder = save_model(old, cfg, tmp_path / "ck", max_shard_bytes=20_000)
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        from lightningrl_fast import checkpoint as ckpt
        from lightningrl_fast.model import SDARConfig, SDARForCausalLM
        real, n = ckpt._write_shard, []
        def dying(tensors, file, metadata):
            n.append(1)
            if len(n) == 2:
                os._exit(9)
            real(tensors, file, metadata)
        ckpt._write_shard = dying
        cfg = SDARConfig.from_json({str(folder / 'config.json')!r})
        torch.manual_seed(5)
        ckpt.save_model(SDARForCausalLM(cfg), cfg, {str(folder)!r}, max_shard_bytes=20_000)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ck"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".ck.tmp-")
    assert_same_state(old, load_model(folder)[0])
    new, _ = tiny_model(seed=2)
    save_model(new, cfg, folder)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    assert_same_state(new, load_model(folder)[0])


def test_interrupted_fallback_swap_is_restored(tmp_path):
    """Killed between the two fallback renames: the hidden backup is named in errors and restored on next save."""
    old, cfg = tiny_model(seed=0)
    folder = save_model(old, cfg, tmp_path / "ck")
    backup = tmp_path / ".ck.old-999999999-deadbeef"  # a pid that cannot be alive
    folder.rename(backup)
    with pytest.raises(FileNotFoundError, match=r"\.ck\.old-999999999"):
        load_model(folder)
    ckpt._clean_leftovers(folder)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    assert_same_state(old, load_model(folder)[0])


def test_failed_fallback_rename_puts_the_previous_checkpoint_back(tmp_path, monkeypatch):
    """Without renameat2 the swap is two renames; when the second one fails the previous checkpoint goes back in
    place (no window left where the path is missing)."""
    old, cfg = tiny_model(seed=0)
    new, _ = tiny_model(seed=1)
    folder = save_model(old, cfg, tmp_path / "ck")
    monkeypatch.setattr(ckpt, "_rename_exchange", lambda a, b: False)
    real_rename = ckpt.os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".ck.tmp-"):  # the new folder moving into place
            raise OSError("rename failed (simulated)")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", rename)
    with pytest.raises(OSError, match="simulated"):
        save_model(new, cfg, folder)
    monkeypatch.setattr(ckpt.os, "rename", real_rename)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]
    assert_same_state(old, load_model(folder)[0])


def test_everything_is_flushed_to_disk_before_the_swap(tmp_path, monkeypatch):
    """The atomic save's promise: every file of the new folder, and the folder itself, is fsynced before it
    replaces the previous checkpoint (else a power loss right after the swap can leave empty files in the
    'complete' checkpoint); the parent folder is synced after the swap."""
    model, cfg = tiny_model()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "generation_config.json").write_text('{"eos_token_id": [1, 2]}')
    folder = save_model(model, cfg, tmp_path / "ck")
    events: list[tuple[str, Path]] = []
    real_fsync, real_exchange = ckpt._fsync, ckpt._rename_exchange
    monkeypatch.setattr(ckpt, "_fsync", lambda p: (events.append(("fsync", Path(p))), real_fsync(p)))

    def exchange(a, b):
        events.append(("swap", Path(a)))
        return real_exchange(a, b)

    monkeypatch.setattr(ckpt, "_rename_exchange", exchange)
    save_model(model, cfg, folder, max_shard_bytes=20_000, tokenizer=tok_dir)
    kinds = [k for k, _ in events]
    assert kinds.count("swap") == 1
    swap = kinds.index("swap")
    tmp = events[swap][1]
    synced_before = {p for k, p in events[:swap] if k == "fsync"}
    names = sorted(p.name for p in folder.iterdir())
    assert "generation_config.json" in names and "model.safetensors.index.json" in names
    for name in names:
        assert tmp / name in synced_before, name
    assert tmp in synced_before
    assert ("fsync", folder.parent) in events[swap:]


def test_a_live_save_of_another_user_is_not_cleaned_up(tmp_path, monkeypatch):
    """A temp folder whose process exists but cannot be signalled (another user's: EPERM) belongs to a save in
    progress: the next save must leave it alone (only dead saves' leftovers are removed)."""
    model, cfg = tiny_model()
    folder = save_model(model, cfg, tmp_path / "ck")
    busy = tmp_path / ".ck.tmp-424242-cafebabe"
    busy.mkdir()
    (busy / "model.safetensors").write_bytes(b"being written")

    def kill(pid, sig):
        if pid == 424242:
            raise PermissionError(1, "Operation not permitted")
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(ckpt.os, "kill", kill)
    save_model(model, cfg, folder)
    assert (busy / "model.safetensors").read_bytes() == b"being written"


def test_save_argument_errors(tmp_path):
    model, cfg = tiny_model(tied=False)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        save_model(model, {**cfg.to_dict(), "tie_word_embeddings": True}, tmp_path / "ck")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        save_model(model, cfg, tmp_path / "file")
    with torch.device("meta"):
        meta_model = SDARForCausalLM(cfg)
    with pytest.raises(ValueError, match="meta"):
        save_model(meta_model, cfg, tmp_path / "ck")
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_shard_bytes must be positive"):
            save_model(model, cfg, tmp_path / "ck", max_shard_bytes=bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
