"""Bad input to the public ops, the model and the sampler: each case raises an error that names the problem before
anything is written (it used to crash deep inside, return a silently wrong result or corrupt an in-place output).
One test per defect found by the audit; the cases that were already handled are in the ops' own test files."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightningrl_fast.model import KVCache, SDARConfig, build_model
from lightningrl_fast.ops import block_attn as block_attn_module
from lightningrl_fast.ops.block_attn import block_attention, block_attention_reference
from lightningrl_fast.ops.grpo_loss import fused_linear_grpo_loss, group_normalize, grpo_token_loss, linear_logprobs
from lightningrl_fast.ops.kv_cache import kv_cache_write
from lightningrl_fast.ops.rms_norm import add_rms_norm, qk_norm_rope, rms_norm
from lightningrl_fast.ops.unmask import threshold_unmask
from lightningrl_fast.sampler import SamplerConfig, generate

V, MASK, EOS = 111, 110, 3
B, C, H, D, L = 2, 4, 2, 8, 16


# -- block_attention / kv_cache_write ------------------------------------------------------------------------------

def attn_args(b=B, c=C, d=D, cap=L):
    q, k, v = (torch.randn(b, c, H, d) for _ in range(3))
    kc, vc = torch.zeros(b, cap, H, d), torch.zeros(b, cap, H, d)
    return q, k, v, kc, vc, torch.zeros(b, dtype=torch.int32), torch.full((b,), c, dtype=torch.int32)


def test_block_attention_empty_batch_and_zero_head_dim():
    """B = 0 crashed in the reference (max() of an empty tensor); head_dim 0 raised ZeroDivisionError."""
    out = block_attention(*attn_args(b=0), 4)
    assert out.shape == (0, C, H, D)
    with pytest.raises(ValueError, match=r"q must have a positive head_dim, got shape \[2, 4, 2, 0\]"):
        block_attention(*attn_args(d=0), 4)


def test_block_attention_block_size_and_scale_are_checked():
    """A float block_size failed in the dispatcher, True was taken as 1; a NaN / inf softmax_scale gave NaN on the
    CPU (the CUDA launcher refuses it)."""
    for bad in (2.5, True, "4"):
        with pytest.raises(TypeError, match="block_size must be an integer"):
            block_attention(*attn_args(), bad)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        block_attention(*attn_args(), 0)
    assert block_attention(*attn_args(), torch.tensor(4)).shape == (B, C, H, D)  # an integer tensor is an integer
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softmax_scale must"):
            block_attention(*attn_args(), 4, softmax_scale=bad)
    for bad in ("0.1", True):
        with pytest.raises(TypeError, match="softmax_scale must be a number"):
            block_attention(*attn_args(), 4, softmax_scale=bad)


def overlapping_caches():
    """(label, k_cache, v_cache, k) triples whose in-place writes would collide."""
    shared = torch.zeros(B, L, H, D)
    strided = torch.zeros(2 * B, L, H, D)[::2]  # not dense: the same tensor twice is still caught
    yield "expanded", torch.zeros(1, L, H, D).expand(B, L, H, D), torch.zeros(B, L, H, D), torch.randn(B, C, H, D)
    yield "same", shared, shared, torch.randn(B, C, H, D)
    yield "same strided", strided, strided, torch.randn(B, C, H, D)
    c2 = torch.zeros(B, L, H, D)
    yield "k inside", c2, torch.zeros(B, L, H, D), c2[:, 2 : 2 + C]
    n = L * H * D
    yield "rows overlap", torch.zeros(B * n).as_strided((B, L, H, D), (n // 2, H * D, D, 1)), torch.zeros(B, L, H, D), \
        torch.randn(B, C, H, D)  # no stride 0, but row 1 starts halfway through row 0
    yield "expanded with gaps", torch.zeros(1, L, 3 * H, D)[:, :, :H].expand(B, L, H, D), torch.zeros(B, L, H, D), \
        torch.randn(B, C, H, D)  # fewer elements than its span: only the stride 0 gives it away
    buf = torch.zeros(B, L, 2 * H, D)
    yield "k holds the cache's last element", buf[:, :, :H], torch.zeros(B, L, H, D), \
        buf.view(-1)[-B * C * H * D :].view(B, C, H, D)  # k dense at the buffer's end: not a start-to-start overlap


@pytest.mark.parametrize("op", ["kv_cache_write", "block_attention"])
def test_caches_that_share_memory_are_refused_before_any_write(op):
    """An expanded cache (rows sharing memory), k_cache == v_cache, or a cache holding the chunk itself was written
    silently on the CPU (rows overwrote each other; the CUDA launchers refuse the first two)."""
    for label, kc, vc, k in overlapping_caches():
        v = torch.randn(B, C, H, D)
        before = (kc.clone(), vc.clone())
        lens, n = torch.zeros(B, dtype=torch.int32), torch.full((B,), C, dtype=torch.int32)
        with pytest.raises(ValueError, match="written in place and must not") as e:
            if op == "kv_cache_write":
                kv_cache_write(kc, vc, k, v, lens, n)
            else:
                block_attention(torch.randn(B, C, H, D), k, v, kc, vc, lens, n, 4)
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]), label
        assert ("k_cache" in str(e.value)), label
    # inputs that are only read may share memory (an expanded k / v: one chunk for every row): accepted
    kc, vc = torch.zeros(B, L, H, D), torch.zeros(B, L, H, D)
    k1, v1 = torch.randn(1, C, H, D), torch.randn(1, C, H, D)
    lens, n = torch.zeros(B, dtype=torch.int32), torch.full((B,), C, dtype=torch.int32)
    kv_cache_write(kc, vc, k1.expand(B, C, H, D), v1.expand(B, C, H, D), lens, n)
    assert torch.equal(kc[:, :C], k1.expand(B, C, H, D)) and torch.equal(vc[:, :C], v1.expand(B, C, H, D))
    block_attention(torch.randn(1, C, H, D).expand(B, C, H, D), k1.expand(B, C, H, D), v1.expand(B, C, H, D),
                    torch.zeros(B, L, H, D), torch.zeros(B, L, H, D), lens, n, 4)
    # interleaved halves of one buffer do not overlap: accepted
    kv = torch.zeros(B, L, 2, H, D)
    kv_cache_write(kv[:, :, 0], kv[:, :, 1], torch.randn(B, C, H, D), torch.randn(B, C, H, D),
                   torch.zeros(B, dtype=torch.int32), torch.full((B,), C, dtype=torch.int32))
    assert kv[:, :C].abs().sum() > 0 and kv[:, C:].abs().sum() == 0


def test_block_attention_out_of_range_rows_output_zeros_without_the_host_check():
    """check_lengths=False: the CPU reference attended a row whose lengths do not fit to stale cache entries; the
    contract (and the kernel) is: nothing written, zero output."""
    q, k, v, kc, vc, _, _ = attn_args()
    kc.normal_(), vc.normal_()
    cache_lens = torch.tensor([14, 0], dtype=torch.int32)  # row 0: 14 + 4 > 16
    chunk_lens = torch.tensor([4, 4], dtype=torch.int32)
    out = block_attention(q, k, v, kc, vc, cache_lens, chunk_lens, 4, check_lengths=False)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert out[1].abs().sum() > 0
    neg = block_attention_reference(q, k, v, kc, vc, torch.tensor([-3, 0], dtype=torch.int32), chunk_lens, 4)
    assert torch.equal(neg[0], torch.zeros_like(neg[0]))


def test_block_attention_passes_dense_lengths_to_the_op(monkeypatch):
    """Strided cache_lens / chunk_lens reached the CUDA launcher, which refuses them (kv_cache_write made them
    dense already)."""
    seen = {}

    def record(q, k, v, kc, vc, cache_lens, chunk_lens, *rest):
        seen["dense"] = cache_lens.is_contiguous() and chunk_lens.is_contiguous()
        return torch.empty_like(q)

    monkeypatch.setattr(block_attn_module, "_block_attention_op", record)
    q, k, v, kc, vc, _, _ = attn_args()
    lens = torch.zeros(2 * B, dtype=torch.int32)[::2]
    n = torch.full((2 * B,), C, dtype=torch.int32)[::2]
    block_attention(q, k, v, kc, vc, lens, n, 4)
    assert seen["dense"]


def test_kv_cache_write_error_flag_of_any_layout():
    """A non-contiguous 2-D error_flag crashed the reference (view(-1)); element (0, 0) is the one that is set."""
    _, k, v, kc, vc, _, n = attn_args()
    flag = torch.zeros(2, 2, dtype=torch.int32).t()
    kv_cache_write(kc, vc, k, v, torch.tensor([20, 0], dtype=torch.int32), n, error_flag=flag, check_lengths=False)
    assert flag.tolist() == [[1, 0], [0, 0]]


# -- threshold_unmask ----------------------------------------------------------------------------------------------

def unmask_args(**kw):
    b, s = 2, 4
    d = dict(logits=torch.randn(b, s, 10), tokens=torch.zeros(b, s, dtype=torch.int64),
             masked=torch.ones(b, s, dtype=torch.bool), step_map=torch.full((b, s), -2, dtype=torch.int32),
             logp=torch.zeros(b, s), conf=torch.zeros(b, s), step=torch.zeros(b, dtype=torch.int32),
             quota=torch.ones(b, dtype=torch.int32), eos_ids=torch.tensor([1]), seed=torch.zeros(1, dtype=torch.int64),
             offset=torch.zeros(1, dtype=torch.int64))
    d.update(kw)
    return d


def test_threshold_unmask_outputs_that_share_memory_are_refused_before_any_write():
    """An expanded `masked` failed inside torch after tokens, step_map, logp and conf had been written (a half-done
    step); logp passed as conf too was written twice, silently."""
    a = unmask_args(masked=torch.ones(1, 4, dtype=torch.bool).expand(2, 4))
    with pytest.raises(ValueError, match="masked is written in place and must not have elements that share memory"):
        threshold_unmask(**a)
    assert a["tokens"].eq(0).all() and a["step_map"].eq(-2).all() and a["conf"].eq(0).all()
    shared = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"logp is written in place and must not share memory with conf \(also "
                                         r"written by this op\)"):
        threshold_unmask(**unmask_args(logp=shared, conf=shared))
    a = unmask_args()
    a["conf"] = a["logits"][..., 0]  # an output inside the logits: the step would read what it overwrote
    with pytest.raises(ValueError, match=r"conf is written in place and must not share memory with logits \(also "
                                         r"read by this op\)"):
        threshold_unmask(**a)
    for name in ("tokens", "step_map", "logp", "conf"):
        t = unmask_args()[name]
        with pytest.raises(ValueError, match=f"{name} is written in place"):
            threshold_unmask(**unmask_args(**{name: t[:1].expand_as(t)}))


def test_threshold_unmask_scalar_arguments_are_checked():
    """A NaN threshold unmasked by quota only, a NaN temperature sampled at temperature 1, an infinite or tiny one
    gave uniform picks / NaN confidences on the CPU (the kernel refuses it); a float top_k was truncated, one beyond
    int64 failed in the dispatcher with "Expected a value of type 'int' ... found type 'int'"."""
    with pytest.raises(ValueError, match="threshold must not be NaN"):
        threshold_unmask(**unmask_args(), threshold=float("nan"))
    with pytest.raises(ValueError, match="temperature must not be NaN"):
        threshold_unmask(**unmask_args(), temperature=float("nan"))
    for t in (float("inf"), 1e-300, 1e39):
        with pytest.raises(ValueError, match="temperature .* is out of the float32 range"):
            threshold_unmask(**unmask_args(), temperature=t)
    with pytest.raises(TypeError, match="top_k must be an integer, got float 2.5"):
        threshold_unmask(**unmask_args(), top_k=2.5)
    with pytest.raises(TypeError, match="threshold must be a number"):
        threshold_unmask(**unmask_args(), threshold="0.9")
    for t in (float("inf"), float("-inf"), 2.0):  # +-inf: top-1 only / everything; fine
        threshold_unmask(**unmask_args(), threshold=t)
    a = unmask_args()
    b = unmask_args(logits=a["logits"])
    threshold_unmask(**a, temperature=1.0, top_k=2**70)  # larger than V: off
    threshold_unmask(**b, temperature=1.0, top_k=0)
    assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["conf"], b["conf"])


# -- GRPO loss ops ---------------------------------------------------------------------------------------------------

def test_group_normalize_no_columns_and_non_finite_weights():
    """rewards [S, 0] crashed in torch.stack; NaN / inf weights gave NaN advantages silently (NaN rewards raised)."""
    g = torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"rewards has no reward columns, got shape \[4, 0\]"):
        group_normalize(torch.zeros(4, 0), g)
    for w in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="weights contain NaN or inf"):
            group_normalize(torch.randn(4, 2), g, torch.tensor([w, 1.0]))


def loss_args(**kw):
    t = 5
    d = dict(logp=torch.randn(t), old_logp=torch.randn(t), ref_logp=torch.randn(t), advantages=torch.randn(t),
             seq_idx=torch.tensor([0, 0, 1, 1, 1]), num_seqs=2, correct=torch.tensor([True, False]))
    d.update(kw)
    return d


def test_grpo_loss_scalar_arguments_are_checked():
    """num_seqs 2.0 failed inside torch.zeros, True was taken as 1; NaN eps / beta / mu or negative / NaN totals
    gave a NaN or sign-flipped loss; reduction None raised AttributeError."""
    with pytest.raises(TypeError, match="num_seqs must be an integer, got float"):
        grpo_token_loss(**loss_args(num_seqs=2.0))
    with pytest.raises(TypeError, match="num_seqs must be an integer, got bool"):
        grpo_token_loss(**loss_args(num_seqs=True, correct=torch.tensor([True])))
    with pytest.raises(ValueError, match="num_seqs must be >= 0, got -1"):
        grpo_token_loss(**loss_args(num_seqs=-1, correct=torch.zeros(0, dtype=torch.bool)))
    for name in ("eps_low", "eps_high", "beta", "mu"):
        with pytest.raises(ValueError, match=f"{name} must not be NaN"):
            grpo_token_loss(**loss_args(), **{name: float("nan")})
    for name in ("beta", "mu"):
        with pytest.raises(ValueError, match=f"{name} must be finite, got inf"):
            grpo_token_loss(**loss_args(), **{name: float("inf")})
    loss, _ = grpo_token_loss(**loss_args(), eps_high=float("inf"))  # no upper clip: allowed
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match=r"totals \(tokens\) must be >= 0"):
        grpo_token_loss(**loss_args(), totals=(2, -5, 1, 2))
    with pytest.raises(ValueError, match=r"totals \(sequences\) must not be NaN"):
        grpo_token_loss(**loss_args(), totals=(float("nan"), 5, 1, 2))
    with pytest.raises(TypeError, match="reduction must be a string"):
        grpo_token_loss(**loss_args(), reduction=None)
    h, w = torch.randn(5, 4), torch.randn(7, 4)
    y = torch.tensor([0, 1, 2, 3, 6])
    with pytest.raises(ValueError, match="mu must not be NaN"):
        a = loss_args()
        fused_linear_grpo_loss(h, w, y, None, a["ref_logp"], a["advantages"], a["seq_idx"], 2, a["correct"],
                               mu=float("nan"))
    for chunk in (2.5, "8"):
        with pytest.raises(TypeError, match="chunk must be an integer"):
            linear_logprobs(h, w, y, chunk=chunk)


def test_suppress_token_must_be_an_integer():
    """suppress_token went through int(): 2.5 suppressed token 2, True token 1 and "3" token 3, silently."""
    h, w = torch.randn(5, 4), torch.randn(7, 4)
    y = torch.tensor([0, 1, 2, 3, 6])
    a = loss_args()
    for bad, what in ((2.5, "float 2.5"), (True, "bool"), ("3", "str '3'")):
        with pytest.raises(TypeError, match=f"suppress_token must be an integer, got {what}"):
            linear_logprobs(h, w, y, suppress_token=bad)
        with pytest.raises(TypeError, match="suppress_token must be an integer"):
            fused_linear_grpo_loss(h, w, y, None, a["ref_logp"], a["advantages"], a["seq_idx"], 2, a["correct"],
                                   suppress_token=bad)
    torch.testing.assert_close(linear_logprobs(h, w, y, suppress_token=torch.tensor(4)),
                               linear_logprobs(h, w, y, suppress_token=4), rtol=0, atol=0)  # an integer tensor is fine


# -- rms_norm ----------------------------------------------------------------------------------------------------------

def test_norm_eps_and_split_types():
    """eps None / "1e-6" failed with "'>=' not supported between ..."; a float split was truncated silently."""
    x, w = torch.randn(3, 8), torch.ones(8)
    for bad in (None, "1e-6"):
        with pytest.raises(TypeError, match="eps must be a number"):
            rms_norm(x, w, bad)
        with pytest.raises(TypeError, match="eps must be a number"):
            add_rms_norm(x, x, w, bad)
    q, cs = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 8)
    with pytest.raises(TypeError, match="split must be an integer, got float 1.5"):
        qk_norm_rope(q, w, cs, cs, 1e-6, w, 1.5)


# -- model -------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    cfg = SDARConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, block_size=4, mask_token_id=MASK, torch_dtype="float32",
                     max_position_embeddings=64)
    return build_model(cfg, dtype=torch.float32).eval()


@torch.no_grad()
def test_model_token_ids_outside_the_vocabulary(model):
    """nn.Embedding raised "IndexError: index out of range in self" (on CUDA: a device-side assert that ends the
    CUDA context); ids past chunk_lens are embedded too on CUDA, so they are checked as well."""
    cache = KVCache.allocate(model.config, 2, 8)
    lens, n = torch.zeros(2, dtype=torch.int32), torch.full((2,), 4, dtype=torch.int32)
    for bad in (V, -1):
        ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, bad]])
        with pytest.raises(ValueError, match=rf"input_ids has token id {bad} outside the vocabulary \[0, {V}\)"):
            model(ids)
        with pytest.raises(ValueError, match=rf"input_ids has token id {bad} outside the vocabulary"):
            model.forward_cached(ids, cache, lens, torch.tensor([4, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="outside the vocabulary"):  # CPU ids: checked for free whatever the flag
        model.hidden_cached(torch.full((2, 4), V), cache, lens, n, check_lengths=False)


@torch.no_grad()
def test_model_inputs_on_another_device_or_float_positions(model):
    """ids or position_ids on another device failed inside torch ("Tensor on device meta is not on the expected
    device cpu!", naming neither); float position_ids were taken as fractional positions."""
    ids = torch.randint(0, 100, (2, 8))
    with pytest.raises(ValueError, match="input_ids is on meta but the model is on cpu"):
        model(ids.to("meta"))
    with pytest.raises(ValueError, match="position_ids is on meta"):
        model(ids, torch.zeros(2, 8, dtype=torch.int64, device="meta"))
    with pytest.raises(TypeError, match="position_ids must have dtype in"):
        model(ids, torch.arange(8.0).expand(2, 8))


@torch.no_grad()
def test_model_forward_cached_checks_lengths_cache_and_block_size(model):
    """cache_lens of the wrong batch failed in a broadcast inside check_cache_lengths, a list with "'<' not
    supported"; a cache with fewer layers raised IndexError, a tuple AttributeError, a 4-D one a misleading batch
    message; block_size=0 silently meant the config's."""
    ids = torch.randint(0, 100, (2, 4))
    cache = KVCache.allocate(model.config, 2, 16)
    lens, n = torch.zeros(2, dtype=torch.int32), torch.full((2,), 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cache_lens must have shape \[2\], got \[3\]"):
        model.forward_cached(ids, cache, torch.zeros(3, dtype=torch.int32), n)
    with pytest.raises(TypeError, match="cache_lens must be a torch.Tensor, got list"):
        model.forward_cached(ids, cache, [0, 0], n)
    with pytest.raises(ValueError, match=r"chunk_lens must have shape \[2\]"):
        model.hidden_cached(ids, cache, lens, torch.full((3,), 4, dtype=torch.int32), check_lengths=False)
    with pytest.raises(ValueError, match=r"cache.k must have shape \[2, \*, \*, 1, 16\], got \[1, 2, 16, 1, 16\]"):
        model.forward_cached(ids, KVCache(cache.k[:1], cache.v[:1]), lens, n)
    with pytest.raises(ValueError, match=r"cache.k must have shape .*got \[2, 16, 1, 16\]"):
        model.forward_cached(ids, KVCache(cache.k[0], cache.v[0]), lens, n)
    with pytest.raises(TypeError, match="cache must be a KVCache, got tuple"):
        model.forward_cached(ids, (cache.k, cache.v), lens, n)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        model.forward_cached(ids, cache, lens, n, block_size=0)


# -- sampler -------------------------------------------------------------------------------------------------------------

CFG = SamplerConfig(temperature=0, max_new_tokens=8, eos_ids=(EOS,))


def test_sampler_block_size_zero_float_or_past_the_positions(model):
    """block_size 0 silently decoded with the model's block size, 2.5 failed inside torch.empty, 1000 (beyond the
    64 positions) decoded a 1000-position block (minutes on this tiny model)."""
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        generate(model, [[5, 6]], dataclasses.replace(CFG, block_size=0))
    with pytest.raises(TypeError, match="block_size must be an integer, got float 2.5"):
        generate(model, [[5, 6]], dataclasses.replace(CFG, block_size=2.5))
    with pytest.raises(ValueError, match="with block_size 1000 the last block ends at position 1000, past the "
                                         "model's max_position_embeddings 64"):
        generate(model, [[5, 6]], dataclasses.replace(CFG, block_size=1000))
    assert generate(model, [[5, 6]], dataclasses.replace(CFG, block_size=64)).tokens.shape == (1, 8)


def test_sampler_config_values_of_the_wrong_type(model):
    """max_new_tokens 2.5 failed inside gather, True meant 1; steps_per_block 2.5 made the int32 quota float and
    failed in threshold_unmask; sync_every 1.5 was used as is; seed 1.5 was truncated, 2**70 raised OverflowError
    and "a" a fill_() error; top_k 2.5 was truncated; a tiny temperature passed the sampler's checks."""
    cases = [("max_new_tokens", 2.5, TypeError, "max_new_tokens must be an integer"),
             ("max_new_tokens", True, TypeError, "max_new_tokens must be an integer, got bool"),
             ("steps_per_block", 2.5, TypeError, "steps_per_block must be an integer"),
             ("sync_every", 1.5, TypeError, "sync_every must be an integer"),
             ("seed", 1.5, TypeError, "seed must be an integer"),
             ("seed", "a", TypeError, "seed must be an integer"),
             ("seed", 2**70, ValueError, "seed must be in"),
             ("top_k", 2.5, TypeError, "top_k must be an integer"),
             ("threshold", "0.9", TypeError, "threshold must be a number"),
             ("temperature", 1e-300, ValueError, "temperature 1e-300 is out of the float32 range")]
    for name, value, exc, match in cases:
        extra = {"rule": "quota"} if name == "steps_per_block" else {}
        with pytest.raises(exc, match=match):
            generate(model, [[5, 6]], dataclasses.replace(CFG, **{name: value}, **extra))
    with pytest.raises(TypeError, match="cfg must be a SamplerConfig, got NoneType"):
        generate(model, [[5, 6]], None)


def test_sampler_eos_and_pad_ids_must_be_ints(model):
    """eos_ids (3.0,) or pad_id 1.5 turned Rollout.tokens into float32; (True,) failed in torch.isin after the whole
    decode; eos_ids=3 raised "'int' object is not iterable"."""
    for eos in ((3.0,), (True,), 3, "3", torch.tensor([3])):
        with pytest.raises(TypeError, match="eos_ids must be a tuple of int token ids"):
            generate(model, [[5, 6]], dataclasses.replace(CFG, eos_ids=eos))
    with pytest.raises(TypeError, match="pad_id must be an integer, got float 1.5"):
        generate(model, [[5, 6]], CFG, pad_id=1.5)
    ro = generate(model, [[5, 6]], dataclasses.replace(CFG, eos_ids=[EOS]), pad_id=-1)
    assert ro.tokens.dtype == torch.int64


def test_sampler_prompts_of_the_wrong_type(model):
    """A prompts tensor raised "Boolean value of Tensor ... is ambiguous"; a prompt given as a tensor, a string or
    with float / numpy ids was reported as ids "outside the vocabulary"; True was decoded as token 1."""
    with pytest.raises(TypeError, match="prompts must be a list of token-id lists, got Tensor"):
        generate(model, torch.tensor([[5, 6]]), CFG)
    with pytest.raises(TypeError, match="prompts must be a list of token-id lists, got str"):
        generate(model, "56", CFG)
    for p, match in ((torch.tensor([5, 6]), "prompt 0 must be a list of int token ids, got Tensor"),
                     ("ab", "prompt 0 must be a list of int token ids, got str"),
                     (5, "prompt 0 must be a list of int token ids, got int"),
                     ([5.0], r"prompt 0 has token id\(s\) that are not ints: \[5.0\]"),
                     ([True, 5], r"prompt 0 has token id\(s\) that are not ints: \[True\]")):
        with pytest.raises(TypeError, match=match):
            generate(model, [p], CFG)
