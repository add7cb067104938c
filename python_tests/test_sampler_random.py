"""Random-configuration tests of the decoding engine (sampler.Decoder / generate): each case draws a whole request
(batch size, prompt lengths around the block boundaries, a block-size override, rule and steps per block, threshold,
greedy or sampled with temperature / top-k / top-p / noise mode / seed, EOS ids the model does produce,
max_new_tokens, folded or separate commits, compaction, packed or unpacked forwards, repeated prompts, the CUDA
cadence of the "all finished?" check, prefill row chunks, a kept Decoder that served another random request first)
and checks every row against the no-cache oracle of test_sampler.py (the whole sequence recomputed every step):
tokens, step map, log-probs, confidences, length, EOS, TPF and the row's forward count. CI runs a fixed few;
LRF_FUZZ_CASES / LRF_FUZZ_SEED run a campaign (conftest.fuzz_cases). test_gpu_random_config replays drawn requests
through captured CUDA graphs on a kept Decoder against eager fresh calls."""

import dataclasses
import random

import pytest
import torch
from conftest import fuzz_cases
from test_sampler import assert_same_rollout, nocache_decode, truncate_at_eos

import lightningrl_fast.sampler as sampler
from lightningrl_fast.model import SDARConfig, build_model
from lightningrl_fast.sampler import Decoder, SamplerConfig, generate

MASK_ID = 110


@pytest.fixture(scope="module")
def models():
    """Two tiny float64 models: vocab 111 (one sampling bucket) and vocab 1301 (two buckets of 1024 ids, so
    two-level and per-token noise pick differently); each with the tokens its greedy decodes produce most, from
    which a case draws EOS ids that do end rows."""
    out = {}
    for name, vocab, seed in (("narrow", 111, 0), ("wide", 1301, 3)):
        cfg = SDARConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, block_size=4,
                         mask_token_id=vocab - 1, torch_dtype="float32", max_position_embeddings=128)
        m = build_model(cfg, dtype=torch.float64, seed=seed).eval()
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in (3, 7, 12, 5)]
        ro = generate(m, prompts, SamplerConfig(threshold=0.5, temperature=0, max_new_tokens=24, eos_ids=(0,)))
        counts = torch.bincount(ro.tokens[ro.response_mask], minlength=vocab)
        out[name] = (m, counts.argsort(descending=True)[:8].tolist())
    return out


def draw_request(rng: random.Random, vocab: int, frequent: list[int]):
    """One request: (prompts, SamplerConfig, sync_every or None, prefill row-chunk size or None)."""
    bs = rng.choice([None, None, 1, 2, 3, 4, 5, 8])
    b = bs or 4
    n = rng.choice([1, 1, 2, 3, 5, 8, 11])
    lengths = [rng.choice([1, max(1, b - 1), b, b + 1, 2 * b, rng.randint(1, 3 * b + 2)]) for _ in range(n)]
    prompts = [[rng.randrange(0, vocab - 1) for _ in range(k)] for k in lengths]  # never the mask token (vocab-1)
    eos = rng.sample(frequent, rng.randint(0, 2)) + rng.sample(range(vocab - 1), rng.randint(0, 2))
    greedy = rng.random() < 0.5
    cfg = SamplerConfig(
        block_size=bs,
        threshold=rng.choice([0.0, 0.05, 0.3, 0.6, 0.9, 1.0, round(rng.random(), 3)]),
        rule=rng.choice(["threshold", "threshold", "quota"]),
        steps_per_block=rng.choice([None, 1, 2, 3, b, b + 2]),
        temperature=0.0 if greedy else rng.choice([0.3, 0.7, 1.0, 1.6]),
        top_k=0 if greedy else rng.choice([0, 0, 1, 3, 20, vocab + 5]),
        top_p=1.0 if greedy else rng.choice([1.0, 1.0, 0.95, 0.6, 0.2]),
        noise=rng.choice(["two_level", "per_token"]),
        max_new_tokens=rng.choice([1, 2, b - 1 if b > 1 else 1, b, b + 1, rng.randint(1, 5 * b + 3)]),
        eos_ids=tuple(dict.fromkeys(eos)) or (rng.randrange(0, vocab - 1),),
        fold_commit=rng.random() < 0.6,
        compact=greedy and rng.random() < 0.7,  # a sampled row's noise is keyed by its index in the working set,
        seed=rng.randrange(0, 2**31),  # which compaction changes: the oracle keeps every row at its index
    )
    sync_every = rng.choice([None, None, 1, 2, 3, 5, 16])  # None: the CPU's check after every step
    prefill_rows = rng.choice([None, None, 1, 2 * b, 5 * b])  # _PREFILL_TOKENS: a few prompt positions per chunk
    cfg = dataclasses.replace(cfg, pack=rng.choice(["auto", "on"]))  # "on": packed forwards (CPU "auto": unpacked)
    if n > 1 and rng.random() < 0.4:  # repeated prompts (an RL group): they prefill once and copy the cache rows
        for i in range(1, n):
            if rng.random() < 0.5:
                prompts[i] = list(prompts[rng.randrange(i)])
    return prompts, cfg, sync_every, prefill_rows


def check_rows(model, prompts, cfg: SamplerConfig, ro) -> None:
    """Every row of the rollout `ro` against the no-cache oracle."""
    assert len(ro) == len(prompts) and ro.tokens.shape == (len(prompts), cfg.max_new_tokens)
    for i, p in enumerate(prompts):
        want = nocache_decode(model, p, cfg, row=i, rows=len(prompts))
        toks = truncate_at_eos(want.tokens.tolist(), cfg.eos_ids)
        n = len(toks)
        assert ro.response_ids(i) == toks, (i, ro.response_ids(i), toks)
        assert ro.step_map[i, :n].tolist() == want.step_map[:n].tolist(), i
        torch.testing.assert_close(ro.logp[i, :n].double(), want.logp[:n], rtol=2.4e-7, atol=1e-9)
        torch.testing.assert_close(ro.conf[i, :n].double(), want.logp[:n].exp(), rtol=2.4e-7, atol=1e-9)
        eos = toks[-1] in cfg.eos_ids
        assert int(ro.lengths[i]) == n and bool(ro.eos_found[i]) == eos
        assert ro.finish_reason[i] == ("eos" if eos else "length")
        assert float(ro.tpf[i]) == pytest.approx(n / len(set(want.step_map[:n].tolist())), rel=1e-6)
        assert int(ro.forwards[i]) == want.forwards, (i, int(ro.forwards[i]), want.forwards)
        # padding after the response: the last EOS id, step -1, no log-prob or confidence
        assert ro.tokens[i, n:].tolist() == [cfg.eos_ids[-1]] * (cfg.max_new_tokens - n)
        assert (ro.step_map[i, n:] == -1).all() and (ro.logp[i, n:] == 0).all() and (ro.conf[i, n:] == 0).all()


def run_request(dec: Decoder, monkeypatch, prompts, cfg, sync_every, prefill_rows):
    """`dec.generate` with the drawn host-check cadence and prefill chunking in force for this call only."""
    with monkeypatch.context() as mp:
        if sync_every is not None:
            mp.setattr(sampler, "_host_check_every", lambda cfg, dev: sync_every)
        if prefill_rows is not None:
            mp.setattr(sampler, "_PREFILL_TOKENS", prefill_rows)
        return dec.generate(prompts, cfg)


@pytest.mark.parametrize("case", fuzz_cases(8))
def test_random_config_equals_nocache_decoding(models, monkeypatch, case):
    """A drawn request decoded by a Decoder equals the no-cache oracle row by row. With probability 1/2 the
    Decoder first serves another drawn request on the same model (also checked), so its buffers, KV cache and
    working-set state carry over from a call of another size, block size and config."""
    rng = random.Random(case)
    model, frequent = models["wide" if rng.random() < 0.25 else "narrow"]
    vocab = model.config.vocab_size
    dec = Decoder(model)
    for _ in range(rng.choice([1, 2])):
        prompts, cfg, sync_every, prefill_rows = draw_request(rng, vocab, frequent)
        ro = run_request(dec, monkeypatch, prompts, cfg, sync_every, prefill_rows)
        check_rows(model, prompts, cfg, ro)


def test_random_requests_reach_every_path(models):
    """The draws of the CI cases (fuzz seed 0) reach what they are for: EOS-ended and length-ended rows, separate
    commits, compaction, both rules, sampling on two buckets, chunked prefill, a kept Decoder's second call."""
    seen = set()
    for case in range(8):
        rng = random.Random(case)
        wide = rng.random() < 0.25
        model, frequent = models["wide" if wide else "narrow"]
        calls = rng.choice([1, 2])
        seen.add("second call" if calls == 2 else "one call")
        for _ in range(calls):
            prompts, cfg, sync_every, prefill_rows = draw_request(rng, model.config.vocab_size, frequent)
            ro = generate(model, prompts, cfg)
            seen |= {"eos" if e else "length" for e in ro.eos_found.tolist()}
            seen |= {cfg.rule, "greedy" if cfg.greedy else ("sampled wide" if wide else "sampled")}
            seen |= {"separate commit"} if not cfg.fold_commit else set()
            seen |= {"compact"} if cfg.compact and len(prompts) >= 2 else set()
            seen |= {"chunked prefill"} if prefill_rows is not None else set()
            seen |= {"cadence"} if sync_every not in (None, 1) else set()
            seen |= {"packed" if cfg.pack == "on" else "unpacked"}
            full = [tuple(p[: len(p) // (cfg.block_size or 4) * (cfg.block_size or 4)]) for p in prompts]
            seen |= {"shared prefill"} if len({f for f in full if f}) < sum(1 for f in full if f) else set()
    want = {"eos", "length", "threshold", "quota", "greedy", "sampled", "separate commit", "compact",
            "chunked prefill", "cadence", "second call", "one call", "packed", "unpacked", "shared prefill"}
    assert want <= seen, want - seen


# ------------------------------------------------------------------------------------------- on a GPU

GPU_FUZZ_CASES = 24  # estimated (not yet timed) at well under a second each: tiny models, < 100 steps per call


@pytest.mark.gpu
@pytest.mark.filterwarnings("error:CUDA graph capture")  # a failed capture would compare eager with eager
@pytest.mark.parametrize("case", fuzz_cases(GPU_FUZZ_CASES))
def test_gpu_random_config(models, monkeypatch, case):
    """Drawn requests on the GPU (bf16, head_dim 64: the block-attention, KV-cache and unmask kernels run) through
    one kept Decoder with captured steps (the drawn cadence: several steps between host checks, compaction into
    new working-set sizes, a second request of another shape) equal eager fresh calls of the same requests on
    the same weights, field for field. Widths stay under 512 positions, where block attention never splits the
    cache (the split count follows the cache capacity, which a kept Decoder's wider buffers would change)."""
    rng = random.Random(case)
    base, frequent = models["wide" if rng.random() < 0.25 else "narrow"]
    cfg_m = dataclasses.replace(base.config, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    model = build_model(cfg_m, dtype=torch.float64, seed=case % 1000).eval().to(device="cuda", dtype=torch.bfloat16)
    dec = Decoder(model)
    for _ in range(rng.choice([1, 2])):
        prompts, cfg, sync_every, prefill_rows = draw_request(rng, cfg_m.vocab_size, frequent)
        cfg = dataclasses.replace(cfg, cuda_graphs=True, sync_every=sync_every or cfg.sync_every)
        with monkeypatch.context() as mp:
            if prefill_rows is not None:
                mp.setattr(sampler, "_PREFILL_TOKENS", prefill_rows)
            got = dec.generate(prompts, cfg)
            want = generate(model, prompts, dataclasses.replace(cfg, cuda_graphs=False))
        assert_same_rollout(got, want)
        assert dec._graphs and all(g.graph is not None and not g.failed for g in dec._graphs.values())
