"""The SDAR model: config parsing, full vs incremental forwards, training layouts, bad inputs."""

import json

import pytest
import torch

from lightningrl_fast.checkpoint import CheckpointError, read_config
from lightningrl_fast.model import KVCache, SDARConfig, SDARForCausalLM, build_model
from lightningrl_fast.ops.masked_attn import MaskLayout

MASK = 110


def tiny_config(**kw):
    base = dict(vocab_size=111, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, block_size=4, mask_token_id=MASK, torch_dtype="float32")
    base.update(kw)
    return SDARConfig(**base)


def incremental_logits(model, ids, bounds, capacity, dtype):
    """Run the chunks [bounds[i], bounds[i+1]) one after another against a fresh cache."""
    cfg = model.config
    bsz = ids.shape[0]
    cache = KVCache.allocate(cfg, bsz, capacity, dtype=dtype)
    cache_lens = torch.zeros(bsz, dtype=torch.int32)
    outs = []
    for c0, c1 in zip(bounds[:-1], bounds[1:]):
        chunk_lens = torch.full((bsz,), c1 - c0, dtype=torch.int32)
        outs.append(model.forward_cached(ids[:, c0:c1], cache, cache_lens, chunk_lens))
        cache_lens += c1 - c0
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("tied", [False, True])
def test_full_forward_equals_incremental(dtype, tol, tied):
    torch.manual_seed(0)
    cfg = tiny_config(tie_word_embeddings=tied)
    model = build_model(cfg, dtype=dtype).eval()
    ids = torch.randint(0, MASK, (3, 23))
    with torch.no_grad():
        full = model(ids)
        # prefill of the first 3 blocks, then block by block, the last one partial
        inc, _ = incremental_logits(model, ids, [0, 12, 16, 20, 23], capacity=24, dtype=dtype)
    torch.testing.assert_close(inc, full, rtol=tol, atol=tol)


def test_cached_forward_checks_lengths_once():
    """hidden_cached validates the lengths itself (one host check per forward, not one per layer) and names the
    problem; the layers call the attention op with the check off."""
    cfg = tiny_config()
    model = build_model(cfg, dtype=torch.float64).eval()
    ids = torch.randint(0, MASK, (2, 8))
    cache = KVCache.allocate(cfg, 2, 16, dtype=torch.float64)
    z = torch.zeros(2, dtype=torch.int32)
    with torch.no_grad():
        with pytest.raises(ValueError, match="row 1: cache_lens \\+ chunk_lens = 20 exceeds the KV cache capacity 16"):
            model.hidden_cached(ids, cache, torch.tensor([0, 12], dtype=torch.int32), torch.tensor([8, 8], dtype=torch.int32))
        with pytest.raises(ValueError, match="chunk_lens <= chunk length 8"):
            model.hidden_cached(ids, cache, z, torch.tensor([9, 8], dtype=torch.int32))
        with pytest.raises(ValueError, match="must be >= 0"):
            model.hidden_cached(ids, cache, torch.tensor([-1, 0], dtype=torch.int32), z + 8)
        model.hidden_cached(ids, cache, z, z + 8)


def test_varlen_rows_in_one_cached_forward():
    """Rows at different cache lengths and chunk lengths in one call match their own full forwards."""
    torch.manual_seed(1)
    cfg = tiny_config()
    model = build_model(cfg, dtype=torch.float64).eval()
    ids = torch.randint(0, MASK, (3, 16))
    cache = KVCache.allocate(cfg, 3, 16, dtype=torch.float64)
    with torch.no_grad():
        model.forward_cached(ids[:, :8], cache, torch.zeros(3, dtype=torch.int32),
                             torch.tensor([0, 4, 8], dtype=torch.int32))
        cache_lens = torch.tensor([0, 4, 8], dtype=torch.int32)
        chunk = torch.stack([ids[0, 0:8], ids[1, 4:12], ids[2, 8:16]])
        out = model.forward_cached(chunk, cache, cache_lens, torch.tensor([8, 5, 8], dtype=torch.int32))
        for b, (c0, n) in enumerate([(0, 8), (4, 5), (8, 8)]):
            full = model(ids[b : b + 1, : c0 + n])[0, c0:]
            torch.testing.assert_close(out[b, :n], full, rtol=1e-12, atol=1e-12)
            assert torch.isfinite(out[b, n:]).all()  # padding rows: defined, meaningless


@pytest.mark.parametrize("seed", range(4))
def test_token_capacity_packs_the_chunk_tokens(seed):
    """hidden_cached(token_capacity=N) runs the layers on N slots (the rows' chunk tokens back to back, then
    padding): every valid position's hidden state and the KV cache after the write equal the [B, C] forward's
    (float64: within float64 rounding of each other, the GEMMs see other shapes), positions past a row's chunk are
    zero, rows of length 0 and a capacity of B x C or more (no packing) included."""
    g = torch.Generator().manual_seed(seed)
    cfg = tiny_config()
    model = build_model(cfg, dtype=torch.float64, seed=seed).eval()
    b, c, cap_len = 5, 8, 24
    ids = torch.randint(0, MASK, (b, c), generator=g)
    cache_lens = torch.randint(0, 3, (b,), generator=g).int() * 4  # [B] block-aligned, mixed
    chunk_lens = torch.randint(0, c + 1, (b,), generator=g).int()
    chunk_lens[seed % b] = 0  # an idle row
    chunk_lens[(seed + 1) % b] = c  # a full one
    valid = int(chunk_lens.sum())
    prior = torch.randn(cfg.num_hidden_layers, b, cap_len, cfg.num_key_value_heads, cfg.head_dim, generator=g,
                        dtype=torch.float64)

    def run(capacity):
        cache = KVCache(prior.clone(), prior.clone() + 1)
        with torch.no_grad():
            h = model.hidden_cached(ids, cache, cache_lens, chunk_lens, token_capacity=capacity)
        return h, cache

    want, want_cache = run(None)
    for capacity in (valid, valid + 1, valid + 7, b * c - 1, b * c, b * c + 5):
        h, cache = run(capacity)
        for r in range(b):
            n = int(chunk_lens[r])
            torch.testing.assert_close(h[r, :n], want[r, :n], rtol=1e-13, atol=1e-13)
            if capacity < b * c:
                assert torch.equal(h[r, n:], torch.zeros_like(h[r, n:])), (capacity, r)
        torch.testing.assert_close(cache.k, want_cache.k, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(cache.v, want_cache.v, rtol=1e-13, atol=1e-13)
    with torch.no_grad(), pytest.raises(ValueError, match=f"chunk_lens sum to {valid} tokens, more than "
                                                          f"token_capacity {valid - 1}"):
        model.hidden_cached(ids, KVCache(prior.clone(), prior.clone()), cache_lens, chunk_lens,
                            check_lengths=True, token_capacity=valid - 1)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="token_capacity"):
            model.hidden_cached(ids, KVCache(prior.clone(), prior.clone()), cache_lens, chunk_lens, token_capacity=bad)
    for bad in (2.5, True):
        with pytest.raises(TypeError, match="token_capacity"):
            model.hidden_cached(ids, KVCache(prior.clone(), prior.clone()), cache_lens, chunk_lens, token_capacity=bad)


def test_block_proxy_reproduces_incremental_masked_block():
    torch.manual_seed(2)
    cfg = tiny_config(block_size=4)
    model = build_model(cfg, dtype=torch.float64).eval()
    n = 16
    x0 = torch.randint(0, MASK, (2, n))
    xt = x0.clone()
    xt[:, 6:] = MASK  # prompt = 6 tokens (tail shares block 1); response fully masked
    with torch.no_grad():
        proxy = model(torch.cat([xt, x0], 1), layout=MaskLayout.block_proxy(n, 4))  # [2, 2n, V]
        for blk in range(1, 4):
            # the incremental state: clean blocks before `blk` cached, block `blk` as x_t
            cache = KVCache.allocate(cfg, 2, n, dtype=torch.float64)
            lens = torch.zeros(2, dtype=torch.int32)
            model.forward_cached(x0[:, : blk * 4], cache, lens, torch.full((2,), blk * 4, dtype=torch.int32))
            lens += blk * 4
            inc = model.forward_cached(xt[:, blk * 4 : blk * 4 + 4], cache, lens, torch.full((2,), 4, dtype=torch.int32))
            torch.testing.assert_close(proxy[:, blk * 4 : blk * 4 + 4], inc, rtol=1e-12, atol=1e-12)
        # the clean half equals the plain block-causal forward
        torch.testing.assert_close(proxy[:, n:], model(x0), rtol=1e-12, atol=1e-12)


def test_trace_layout_rounds_match_incremental_states():
    torch.manual_seed(3)
    cfg = tiny_config(block_size=4)
    model = build_model(cfg, dtype=torch.float64).eval()
    n, rounds = 12, 3
    x0 = torch.randint(0, MASK, (1, n))
    copies = []
    for r in range(rounds):  # round r: in every block, positions with in-block index >= r still masked
        xr = x0.clone()
        for p in range(n):
            if p % 4 >= r:
                xr[0, p] = MASK
        copies.append(xr)
    inp = torch.cat(copies + [x0], 1)
    with torch.no_grad():
        out = model(inp, layout=MaskLayout(n, rounds + 1, 4))
        for r in range(rounds):
            for blk in range(3):
                if blk == 0:
                    inc = model(copies[r][:, :4])
                else:
                    cache = KVCache.allocate(cfg, 1, n, dtype=torch.float64)
                    lens = torch.zeros(1, dtype=torch.int32)
                    model.forward_cached(x0[:, : blk * 4], cache, lens, torch.tensor([blk * 4], dtype=torch.int32))
                    lens += blk * 4
                    inc = model.forward_cached(copies[r][:, blk * 4 : blk * 4 + 4], cache, lens,
                                               torch.tensor([4], dtype=torch.int32))
                got = out[:, r * n + blk * 4 : r * n + blk * 4 + 4]
                torch.testing.assert_close(got, inc, rtol=1e-12, atol=1e-12)


def test_padding_keys_are_never_attended():
    torch.manual_seed(4)
    cfg = tiny_config()
    model = build_model(cfg, dtype=torch.float64).eval()
    ids = torch.randint(0, MASK, (1, 12))
    noisy = ids.clone()
    noisy[0, 9:] = torch.randint(0, MASK, (3,))  # different garbage in the padding
    lay = MaskLayout.block_causal(12, 4, torch.tensor([9]))
    with torch.no_grad():
        a = model(ids, layout=lay)[:, :9]
        b = model(noisy, layout=lay)[:, :9]
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bf16_model_runs_and_gradient_checkpointing_matches():
    torch.manual_seed(5)
    cfg = tiny_config()
    model = build_model(cfg, dtype=torch.float32).train()
    ids = torch.randint(0, MASK, (2, 12))
    model(ids).sum().backward()
    g0 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.gradient_checkpointing = True
    model(ids).sum().backward()
    for a, p in zip(g0, model.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-6)
    bf = build_model(cfg, dtype=torch.bfloat16)
    assert bf(ids).dtype == torch.bfloat16


def test_config_roundtrip_and_errors(tmp_path):
    d = tiny_config().to_dict()
    d["some_unknown_key"] = {"kept": True}
    cfg = SDARConfig.from_dict(d)
    assert cfg.to_dict()["some_unknown_key"] == {"kept": True}
    assert SDARConfig.from_dict(cfg.to_dict()) == cfg
    bad = dict(d)
    del bad["hidden_size"]
    with pytest.raises(KeyError, match="hidden_size"):
        SDARConfig.from_dict(bad)
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(KeyError, match="config.json.*hidden_size"):
        SDARConfig.from_json(tmp_path)
    with pytest.raises(ValueError, match="mask_token_id 200 is outside"):
        SDARConfig.from_dict({**d, "mask_token_id": 200})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        SDARConfig.from_dict({**d, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="rope_scaling"):
        SDARConfig.from_dict({**d, "rope_scaling": {"type": "yarn"}})
    no_mask = dict(d)
    del no_mask["mask_token_id"]
    assert SDARConfig.from_dict({**no_mask, "vocab_size": 151936}).mask_token_id == 151669
    with pytest.raises(FileNotFoundError, match="no config.json"):
        SDARConfig.from_json(tmp_path / "nowhere")


def test_config_keys_left_out_mean_what_the_official_config_assumes():
    """A config.json without head_dim / rope_theta / num_key_value_heads: the official SDARConfig (a Qwen3Config)
    takes 128 / 10000 / 32; rope_scaling spelled as the default is plain RoPE; transformers' newer `dtype` key
    stands for torch_dtype and is not kept as a second, possibly conflicting entry."""
    base = dict(vocab_size=111, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=32,
                mask_token_id=110)
    cfg = SDARConfig.from_dict(base)
    assert (cfg.head_dim, cfg.rope_theta, cfg.num_key_value_heads) == (128, 10000.0, 32)
    null_kv = {**base, "num_attention_heads": 8, "num_key_value_heads": None}
    assert SDARConfig.from_dict(null_kv).num_key_value_heads == 8  # an explicit null: as many as the q heads
    assert SDARConfig.from_dict({**base, "num_key_value_heads": 8, "head_dim": 16}).head_dim == 16
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        SDARConfig.from_dict({**base, "num_attention_heads": 4})  # 4 heads, 32 kv heads by default
    for spelled in ({"rope_type": "default"}, {"type": "default"}, {}):
        assert SDARConfig.from_dict({**base, "rope_scaling": spelled}).rope_scaling is None
    cfg = SDARConfig.from_dict({**base, "dtype": "float32"})
    assert cfg.torch_dtype == "float32" and "dtype" not in cfg.to_dict()
    cfg = SDARConfig.from_dict({**base, "dtype": "float16", "torch_dtype": "bfloat16"})
    assert cfg.torch_dtype == "bfloat16" and "dtype" not in cfg.to_dict()


@pytest.mark.parametrize("keys, named", [
    ({"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}, "mixture-of-experts.*128"),
    ({"attention_bias": True}, "attention_bias true"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "sliding-window attention.*4096"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types.*sliding_attention"),
])
def test_configs_of_other_architectures_are_refused(tmp_path, keys, named):
    """A config whose other keys describe layers this model does not compute (experts, biases, a sliding window)
    is refused by name, not loaded as a dense SDAR model that would silently compute something else; the keys
    the real SDAR configs carry with their dense values load."""
    d = tiny_config().to_dict()
    with pytest.raises(ValueError, match=f"{named}.*not supported"):
        SDARConfig.from_dict({**d, **keys})
    (tmp_path / "config.json").write_text(json.dumps({**d, **keys}))
    with pytest.raises(CheckpointError, match=f"config.json.*{named}"):
        read_config(tmp_path)
    dense = {"num_experts": 0, "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
             "layer_types": ["full_attention"] * d["num_hidden_layers"]}
    assert SDARConfig.from_dict({**d, **dense}).extra["attention_bias"] is False
    no_window = SDARConfig.from_dict({**d, "use_sliding_window": True, "sliding_window": None})
    assert no_window.hidden_size == d["hidden_size"]


def test_bad_model_inputs():
    cfg = tiny_config()
    model = build_model(cfg, dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple of block_size"):
        KVCache.allocate(cfg, 2, 10)
    with pytest.raises(ValueError, match="input_ids must be an int"):
        model(torch.zeros(2, 4))
    cache = KVCache.allocate(cfg, 2, 8)
    with pytest.raises(ValueError, match="batch 3 != KV cache batch 2"):
        model.forward_cached(torch.zeros(3, 4, dtype=torch.long), cache, torch.zeros(3, dtype=torch.int32),
                             torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="exceeds the KV cache capacity 8"):
        model.forward_cached(torch.zeros(2, 4, dtype=torch.long), cache, torch.tensor([0, 8], dtype=torch.int32),
                             torch.tensor([4, 4], dtype=torch.int32))


def test_meta_device_parameter_names_match_sdar_4b():
    import pathlib

    meta = pathlib.Path(__file__).resolve().parents[2] / "shared" / "sdar-meta" / "SDAR-4B-Chat"
    if not meta.is_dir():
        pytest.skip("shared/sdar-meta is not beside the checkout")
    cfg = SDARConfig.from_json(meta / "config.json")
    with torch.device("meta"):
        model = SDARForCausalLM(cfg)
    names = set(json.loads((meta / "model.safetensors.index.json").read_text())["weight_map"])
    assert set(model.state_dict_for_save()) == names


def _packed_groups(model):
    from lightningrl_fast.model import packed_weight

    return [packed_weight(m._projections()) for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_packed_decode_weights_give_the_same_forward(dtype, tol):
    """pack_decode_weights: q/k/v and gate/up become views of one storage per group (same parameter objects and
    values), the cached forward runs the packed GEMMs and matches the full forward and the unpacked one."""
    torch.manual_seed(1)
    model = build_model(tiny_config(), dtype=dtype).eval()
    ids = torch.randint(0, MASK, (3, 23))
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        full = model(ids)
        plain, _ = incremental_logits(model, ids, [0, 12, 16, 20, 23], capacity=24, dtype=dtype)
    assert all(w is None for w in _packed_groups(model))
    model.pack_decode_weights()
    assert dict(model.named_parameters()) == params  # the same objects, under the same SDAR names
    for n, p in params.items():
        assert torch.equal(p, before[n]), n
    groups = _packed_groups(model)
    assert all(w is not None for w in groups)
    attn = model.model.layers[0].self_attn
    assert torch.equal(groups[0], torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    storage = attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == storage
    data_ptrs = [p.data_ptr() for p in model.parameters()]
    model.pack_decode_weights()  # packed already: nothing moves
    assert [p.data_ptr() for p in model.parameters()] == data_ptrs
    with torch.no_grad():
        packed, _ = incremental_logits(model, ids, [0, 12, 16, 20, 23], capacity=24, dtype=dtype)
        full_after = model(ids)
    torch.testing.assert_close(packed, plain, rtol=tol, atol=tol)
    torch.testing.assert_close(packed, full, rtol=tol, atol=tol)
    assert torch.equal(full_after, full)  # training forwards use the (same-valued) separate parameters


def test_packing_survives_optimizer_steps_and_is_undone_by_assignment(tmp_path):
    """An optimizer step updates the parameters in place, so the packed view follows it; a load with
    assign=True replaces them, the packing is gone, the cached forward falls back to separate GEMMs, and
    saving a packed model writes only the parameters' own bytes."""
    from lightningrl_fast.checkpoint import load_model, save_model
    from lightningrl_fast.rl.optim import make_optimizer

    torch.manual_seed(2)
    cfg = tiny_config()
    model = build_model(cfg, dtype=torch.float32).pack_decode_weights()
    opt = make_optimizer(model.parameters(), lr=1e-2)
    ids = torch.randint(0, MASK, (2, 8))
    model(ids).float().pow(2).mean().backward()
    opt.step()
    groups = _packed_groups(model)
    assert all(w is not None for w in groups)
    mlp = model.model.layers[1].mlp
    assert torch.equal(groups[3], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))

    folder = save_model(model, cfg, tmp_path / "ckpt")
    loaded, _ = load_model(folder, dtype=torch.float32)
    stored = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    assert own <= stored < own + 65536  # no parameter dragged its packed neighbours into the file
    for n, p in model.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[n], p), n

    state = {n: p.detach().clone() + 1 for n, p in model.named_parameters()}
    model.load_state_dict(state, assign=True)
    assert all(w is None for w in _packed_groups(model))
    cache = KVCache.allocate(cfg, 2, 8, dtype=torch.float32)
    lens = torch.zeros(2, dtype=torch.int32)
    with torch.no_grad():
        out = model.forward_cached(ids, cache, lens, lens + 8)
        torch.testing.assert_close(out, model(ids), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_forward_weight_bytes_counts_what_a_decode_forward_reads(tied):
    cfg = tiny_config(tie_word_embeddings=tied)
    model = build_model(cfg, dtype=torch.bfloat16)
    h, v, inter = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h + 2 * cfg.head_dim  # projections, 2 norms, q/k norms
    expected = cfg.num_hidden_layers * per_layer + h + v * h  # + final norm + LM head (the tied table counted once)
    assert model.forward_weight_bytes() == 2 * expected
    model.pack_decode_weights()  # packed q/k/v and gate/up views: still each byte once
    assert model.forward_weight_bytes() == 2 * expected


def qwen3_oracle(params: dict, cfg: SDARConfig, ids: torch.Tensor, block_size: int,
                 dt: torch.dtype = torch.float64) -> torch.Tensor:
    """REFERENCE §1 written out from scratch, every step in `dt` (float64: the oracle): embedding, per layer pre-RMSNorm (eps), q/k/v projections,
    per-head RMSNorm of q and k BEFORE half-split rotate_half RoPE (theta), GQA (q head h reads kv head
    h // (Hq / Hkv)), scale head_dim^-0.5, block-causal mask (a query sees every key of its block and earlier
    blocks), o_proj, residual, post-attention RMSNorm, SwiGLU MLP, residual; final norm; lm_head (no logit shift)."""
    p = {k: v.detach().to(dt) for k, v in params.items()}
    eps, d, hq, hkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    bsz, n = ids.shape

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    pos = torch.arange(n, dtype=dt)
    inv = torch.tensor([cfg.rope_theta ** (-2.0 * i / d) for i in range(d // 2)], dtype=dt)
    ang = pos[:, None] * inv[None]  # [n, d/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)  # [n, d]

    def rope(x):  # [b, n, h, d]; rotate_half(x) = (-x2, x1)
        rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
        return x * cos[None, :, None] + rot * sin[None, :, None]

    blk = torch.arange(n) // block_size
    allowed = blk[None, :] <= blk[:, None]  # [q, k]
    x = p["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        h = rms(x, p[pre + "input_layernorm.weight"])
        q = (h @ p[pre + "self_attn.q_proj.weight"].T).view(bsz, n, hq, d)
        k = (h @ p[pre + "self_attn.k_proj.weight"].T).view(bsz, n, hkv, d)
        v = (h @ p[pre + "self_attn.v_proj.weight"].T).view(bsz, n, hkv, d)
        q, k = rope(rms(q, p[pre + "self_attn.q_norm.weight"])), rope(rms(k, p[pre + "self_attn.k_norm.weight"]))
        o = torch.empty(bsz, n, hq, d, dtype=dt)
        for head in range(hq):
            kv = head // (hq // hkv)
            s = torch.einsum("bqd,bkd->bqk", q[:, :, head], k[:, :, kv]) * d ** -0.5
            s = s.masked_fill(~allowed, float("-inf"))
            o[:, :, head] = torch.softmax(s, -1) @ v[:, :, kv]
        x = x + o.reshape(bsz, n, hq * d) @ p[pre + "self_attn.o_proj.weight"].T
        h = rms(x, p[pre + "post_attention_layernorm.weight"])
        g, u = h @ p[pre + "mlp.gate_proj.weight"].T, h @ p[pre + "mlp.up_proj.weight"].T
        x = x + (g * torch.sigmoid(g) * u) @ p[pre + "mlp.down_proj.weight"].T
    x = rms(x, p["model.norm.weight"])
    head_w = p["model.embed_tokens.weight"] if cfg.tie_word_embeddings else p["lm_head.weight"]
    return x @ head_w.T


@pytest.mark.parametrize("tied", [False, True])
def test_forward_matches_an_independent_float64_oracle(tied):
    """The model against the architecture itself (every other test here compares the model with itself: a wrong
    RoPE, norm or head mapping shared by the full and the cached forward would pass them). Random norm weights
    (init sets them to 1, which hides a swapped q_norm / k_norm), theta 1e4 so that every RoPE frequency turns,
    GQA 4/2, 23 positions, vocab 111. float32 model vs the float64 oracle: within 2x the error of the oracle run
    in float32; the cached (decode) forward too."""
    cfg = tiny_config(tie_word_embeddings=tied, rope_theta=1e4, rms_norm_eps=1e-5)
    model = build_model(cfg, dtype=torch.float64, seed=3).eval()
    g = torch.Generator().manual_seed(11)
    _scaled(model, g)
    ids = torch.randint(0, 111, (3, 23), generator=g)
    params = dict(model.named_parameters())
    if tied:
        params.pop("lm_head.weight", None)
    want = qwen3_oracle(params, cfg, ids, 4)
    err_ref = (qwen3_oracle(params, cfg, ids, 4, torch.float32).double() - want).abs().max().item()
    m32 = model.float()
    with torch.no_grad():
        got = m32(ids).double()
        cached, _ = incremental_logits(m32, ids, [0, 12, 16, 20, 23], capacity=24, dtype=torch.float32)
    assert want.abs().max() > 1.0 and err_ref > 0
    for out in (got, cached.double()):
        err = (out - want).abs().max().item()
        assert err <= 2 * err_ref, (err, err_ref)


def _scaled(model, g: torch.Generator | None = None):
    """Weights x10 (std 0.2: attention and MLP far from linear) and random norm weights (init sets them to 1,
    which hides a swapped q_norm / k_norm)."""
    g = g if g is not None else torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if name.endswith("norm.weight"):
                prm.copy_(0.5 + torch.rand(prm.shape, generator=g, dtype=torch.float64))
            else:
                prm.mul_(10.0)
    return model


def _err(got, want):
    """Max abs error relative to the largest logit (the model computes RoPE's cos/sin in float32, ~1e-7)."""
    return ((got - want).abs().max() / want.abs().max()).item()


def test_block_size_override_matches_the_oracle():
    """A block size other than the config's (a b8 decode of a b4 config): the cached forward's `block_size`
    and a MaskLayout's block size give the float64 oracle's block-causal mask at that size (chunks of 8 over
    19 positions, the last one partial), not the config's."""
    cfg = tiny_config()  # block_size 4
    model = _scaled(build_model(cfg, dtype=torch.float64, seed=6).eval())
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, MASK, (2, 19), generator=g)
    want = qwen3_oracle(dict(model.named_parameters()), cfg, ids, 8)
    cache = KVCache.allocate(cfg, 2, 24, dtype=torch.float64)
    lens, outs = torch.zeros(2, dtype=torch.int32), []
    with torch.no_grad():
        for c0, c1 in ((0, 8), (8, 16), (16, 19)):
            outs.append(model.forward_cached(ids[:, c0:c1], cache, lens, torch.full((2,), c1 - c0, dtype=torch.int32),
                                             block_size=8))
            lens += c1 - c0
        full = model(ids, layout=MaskLayout.block_causal(19, 8))
    assert _err(torch.cat(outs, 1), want) < 1e-5, _err(torch.cat(outs, 1), want)
    assert _err(full, want) < 1e-5, _err(full, want)


def test_weights_sharing_a_storage_out_of_order_are_not_a_packed_group():
    """q/k/v (gate/up) weights that share one storage but do not lie back to back in that order (q, v, k; gate,
    other rows, up — as parameters assigned from one memory-mapped buffer may) are no packed group: the cached
    forward runs separate GEMMs and matches the float64 oracle, and pack_decode_weights repacks them in order."""
    from lightningrl_fast.model import packed_weight

    cfg = tiny_config()
    model = _scaled(build_model(cfg, dtype=torch.float64, seed=4).eval())
    with torch.no_grad():
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            junk = torch.ones_like(m.up_proj.weight)
            for parts in ([a.q_proj.weight, a.v_proj.weight, a.k_proj.weight],
                          [m.gate_proj.weight, junk, m.up_proj.weight]):
                buf, row = torch.cat([p.detach() for p in parts]), 0
                for p in parts:
                    p.data = buf[row : row + p.shape[0]]
                    row += p.shape[0]
            assert packed_weight(a._projections()) is None and packed_weight(m._projections()) is None
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, MASK, (2, 13), generator=g)
    want = qwen3_oracle(dict(model.named_parameters()), cfg, ids, 4)
    with torch.no_grad():
        got, _ = incremental_logits(model, ids, [0, 8, 12, 13], capacity=16, dtype=torch.float64)
        assert _err(got, want) < 1e-5, _err(got, want)
        model.pack_decode_weights()
        a, m = model.model.layers[1].self_attn, model.model.layers[1].mlp
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        assert torch.equal(packed_weight(a._projections()), qkv)
        assert torch.equal(packed_weight(m._projections()), torch.cat([m.gate_proj.weight, m.up_proj.weight]))
        got, _ = incremental_logits(model, ids, [0, 8, 12, 13], capacity=16, dtype=torch.float64)
    assert _err(got, want) < 1e-5, _err(got, want)


def test_rope_tables_at_long_positions_in_bf16():
    """cos/sin of a bf16 model at positions past 256 (where bf16 cannot hold every integer) equal the float64
    formula cos(p * theta^(-2i/d)), half-split (frequency i at columns i and i + d/2), up to bf16 rounding: the
    angles are formed from the exact integer positions, never from positions rounded to the model's dtype."""
    from lightningrl_fast.model import rope_cos_sin

    d, theta = 16, 1e4
    pos = torch.arange(997, 997 + 97).view(1, 97)
    cos, sin = rope_cos_sin(pos, d, theta, torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16 and cos.shape == (1, 97, d)
    inv = torch.tensor([theta ** (-2.0 * i / d) for i in range(d // 2)], dtype=torch.float64)
    ang = pos.double()[..., None] * inv  # [1, 97, d/2]
    for got, f in ((cos, torch.cos), (sin, torch.sin)):
        want = f(torch.cat([ang, ang], -1))
        assert (got.double() - want).abs().max().item() < 1e-2
