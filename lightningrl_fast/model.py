"""The SDAR block-diffusion transformer (Qwen3 dense decoder; REFERENCE §1), its config and its KV cache.

One model, three ways to run it:
  * `forward(input_ids, position_ids, layout)` — full sequences under a `MaskLayout` predicate:
    block-causal (layout None), the block-proxy training layout [x_t ; x_0], or trace replay; or under a
    `PackedLayout`: several such sequences back to back in a row (the trainer's packed micro-batches).
  * `forward_cached(input_ids, cache, cache_lens, chunk_lens)` — incremental: a chunk of new tokens per
    row against a preallocated static-shape `KVCache` (prefill, one denoising block, or a finished block
    folded with the next). The chunk's K/V are written into the cache; the caller advances the lengths.
    On CUDA its norms run as one fused op each (`ops.add_rms_norm` with the residual add before each norm,
    and `ops.qk_norm_rope` for q/k-norm + RoPE, q and k together when the weights are packed) instead of
    ~10 eager launches; elsewhere, and in the other forwards (which need autograd), the eager
    modules run: the same formulas, so results agree up to the fp32 sum order (ops/rms_norm.py).
  * `hidden(...)` variants return the final normalized hidden states for fused losses.
`pack_decode_weights()` lays each layer's q/k/v and gate/up weights back to back in one storage (the
parameters stay separate, with their SDAR names, and become views of it), so the cached forward runs one
GEMM for q/k/v and one for gate/up instead of five; optimizer steps update the parameters in place and keep
the packing; anything that replaces a parameter (`load_state_dict(assign=True)`, `.to(dtype)`) undoes it,
and the cached forward then runs the separate GEMMs until the next pack (the sampler packs once per call).
Parameter names are exactly those of SDAR safetensors checkpoints. There is no logit shift: the logit at
position i predicts the token at position i.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .ops._common import check_int, check_tensor, host_checks_allowed, pdl_allowed
from .ops.block_attn import block_attention, check_cache_lengths
from .ops.linear import linear
from .ops.masked_attn import MaskLayout, PackedLayout, masked_attention, prepare
from .ops.rms_norm import add_rms_norm, qk_norm_rope, rms_norm
from .ops.silu_mul import silu_mul

DEFAULT_MASK_TOKEN_ID = 151669
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# What the official SDARConfig (a Qwen3Config) takes for a key that config.json leaves out; `from_dict` follows
# it so that such a folder means the same model here and under transformers.
_OFFICIAL_DEFAULTS = {"num_key_value_heads": 32, "head_dim": 128, "rope_theta": 10000.0}


def _unsupported_architecture(extra: dict[str, Any]) -> str | None:
    """What in a config's other keys describes a model this file does not compute (None: nothing)."""
    experts = extra.get("num_experts")
    if isinstance(experts, int) and not isinstance(experts, bool) and experts > 0:
        return f"a mixture-of-experts checkpoint (config.num_experts {experts}, e.g. SDAR-30B-A3B)"
    if extra.get("attention_bias") is True:
        return "config.attention_bias true (biases on the q/k/v/o projections)"
    if extra.get("use_sliding_window") is True and extra.get("sliding_window") is not None:
        return f"sliding-window attention (config.use_sliding_window true, sliding_window {extra['sliding_window']})"
    kinds = extra.get("layer_types")
    if isinstance(kinds, list) and any(k != "full_attention" for k in kinds):
        return f"config.layer_types {sorted(set(map(str, kinds)))} (only full_attention layers are computed here)"
    return None


@dataclass
class SDARConfig:
    """The config.json of an SDAR/TraDo/LightningRL checkpoint. Unknown keys are kept in `extra`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    block_size: int = 4
    mask_token_id: int = DEFAULT_MASK_TOKEN_ID
    hidden_act: str = "silu"
    rope_scaling: dict | None = None
    model_type: str = "sdar"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"config.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"config.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"config.mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.hidden_act != "silu":
            raise ValueError(f"config.hidden_act {self.hidden_act!r} is not supported (SDAR uses 'silu')")
        if isinstance(self.rope_scaling, dict):
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind == "default":
                self.rope_scaling = None  # plain RoPE, spelled out (or an empty dict)
        if self.rope_scaling:
            raise ValueError(f"config.rope_scaling {self.rope_scaling!r} is not supported (SDAR checkpoints use none)")
        if self.torch_dtype not in _DTYPES:
            raise ValueError(f"config.torch_dtype {self.torch_dtype!r} is not one of {sorted(_DTYPES)}")
        unsupported = _unsupported_architecture(self.extra)
        if unsupported:
            raise ValueError(f"{unsupported} is not supported: this package implements the dense SDAR model "
                             "(SDAR / TraDo 1.7B, 4B, 8B)")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SDARConfig":
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise KeyError(f"config is missing required key(s): {', '.join(missing)}")
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in known}
        for k, v in _OFFICIAL_DEFAULTS.items():
            if kwargs.get(k) is None and not (k == "num_key_value_heads" and k in d):  # an explicit null: = heads
                kwargs[k] = v
        if kwargs.get("mask_token_id") is None:
            kwargs["mask_token_id"] = DEFAULT_MASK_TOKEN_ID
        dtype = kwargs.pop("torch_dtype", None) or d.get("dtype")  # newer transformers write `dtype`
        if dtype is not None:
            kwargs["torch_dtype"] = str(dtype).replace("torch.", "")
        extra = {k: v for k, v in d.items() if k not in known and k != "dtype"}  # torch_dtype carries `dtype`
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json(cls, path: str | Path) -> "SDARConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(d)
        except (KeyError, ValueError) as e:
            raise type(e)(f"{path}: {e.args[0]}") from None

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.extra)
        d.update({f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"})
        d.setdefault("architectures", ["SDARForCausalLM"])
        return d


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (Qwen3 convention)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _decode_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The cached (decode) forward's norm: one fused launch on CUDA, the eager module elsewhere."""
    return rms_norm(x, norm.weight, norm.eps) if x.is_cuda and norm.weight.dtype == x.dtype else norm(x)


def _decode_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The decode forward's GEMMs through `ops.linear`: its skinny-GEMM kernel on CUDA for <= 64 tokens when
    $LRF_DECODE_GEMM=kernel, F.linear otherwise. pdl: the kernel launched before each of these GEMMs (a norm,
    the attention, silu_mul) never writes the weights, so the GEMM may start streaming them early (LRF_PDL=0: off)."""
    return linear(x, weight, pdl=x.is_cuda and pdl_allowed())


def _decode_add_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x): the decode forward's residual add and the following norm, one fused
    launch on CUDA (`ops.add_rms_norm`), the eager add and module elsewhere."""
    if x.is_cuda and norm.weight.dtype == x.dtype == residual.dtype:
        return add_rms_norm(x, residual, norm.weight, norm.eps)
    s = residual + x
    return norm(s), s


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [B, N, head_dim] for half-split rotate_half RoPE, computed in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # [B, N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, N, H, D]; cos/sin [B, N, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rot * sin[:, :, None]


def packed_weight(linears: list[nn.Linear]) -> torch.Tensor | None:
    """The weights of `linears` stacked along the output dim [sum(out), in] as a zero-copy view, when they lie
    back to back in one storage (after `pack_linears`); None otherwise."""
    ws = [m.weight for m in linears]
    w0 = ws[0]
    ptr = w0.data_ptr()
    for w in ws:
        if (w.dtype != w0.dtype or w.device != w0.device or w.dim() != 2 or w.shape[1] != w0.shape[1]
                or not w.is_contiguous() or w.data_ptr() != ptr
                or w.untyped_storage().data_ptr() != w0.untyped_storage().data_ptr()):
            return None
        ptr += w.numel() * w.element_size()
    rows = sum(w.shape[0] for w in ws)  # the last weight ends inside the shared storage, so the view does too
    return torch.as_strided(w0.detach(), (rows, w0.shape[1]), (w0.shape[1], 1))


@torch.no_grad()
def pack_linears(linears: list[nn.Linear]) -> None:
    """Move the weights of `linears` into one new storage, back to back; each parameter (same object, same
    values, same requires_grad) becomes a view of its rows. A no-op when they are packed already."""
    if packed_weight(linears) is not None:
        return
    buf = torch.cat([m.weight.detach() for m in linears])  # [sum(out), in]
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = buf[row : row + n]
        row += n


class Attention(nn.Module):
    def __init__(self, cfg: SDARConfig) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.hq * self.d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.hq * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, n, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, n, self.hq, self.d)), cos, sin)  # [B, N, Hq, D]
        k = apply_rope(self.k_norm(self.k_proj(x).view(b, n, self.hkv, self.d)), cos, sin)  # [B, N, Hkv, D]
        v = self.v_proj(x).view(b, n, self.hkv, self.d)  # [B, N, Hkv, D]
        return q, k, v

    def forward(self, x, cos, sin, layout: MaskLayout | PackedLayout, plan) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        o = masked_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout, plan)  # [B, Hq, N, D]
        return self.o_proj(o.transpose(1, 2).reshape(b, n, self.hq * self.d))

    def _projections(self) -> list[nn.Linear]:
        return [self.q_proj, self.k_proj, self.v_proj]

    def forward_cached(self, x, cos, sin, k_cache, v_cache, cache_lens, chunk_lens, block_size, packed=None) -> torch.Tensor:
        """Lengths are checked once by SDARForCausalLM.hidden_cached, not here (a device sync per layer)."""
        b, n, _ = x.shape
        w = packed_weight(self._projections())
        if w is not None:  # one GEMM; q, k, v are views of its output
            qkv = _decode_linear(x, w)  # [B, N, (Hq + 2 Hkv) D]
            q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k = q.view(b, n, self.hq, self.d), k.view(b, n, self.hkv, self.d)  # [B, N, Hq | Hkv, D]
        v = v.view(b, n, self.hkv, self.d)  # [B, N, Hkv, D]
        fused = x.is_cuda and self.q_norm.weight.dtype == self.k_norm.weight.dtype == x.dtype == cos.dtype
        if fused and w is not None and self.q_norm.eps == self.k_norm.eps:  # q and k heads side by side: one launch
            qk = qkv[..., : (self.hq + self.hkv) * self.d].view(b, n, self.hq + self.hkv, self.d)
            qk = qk_norm_rope(qk, self.q_norm.weight, cos, sin, self.q_norm.eps, self.k_norm.weight,
                              self.hq)  # [B, N, Hq + Hkv, D]
            q, k = qk[:, :, : self.hq], qk[:, :, self.hq :]  # [B, N, Hq, D], [B, N, Hkv, D]
        elif fused:  # q/k-norm + RoPE: one launch each
            q = qk_norm_rope(q, self.q_norm.weight, cos, sin, self.q_norm.eps)  # [B, N, Hq, D]
            k = qk_norm_rope(k, self.k_norm.weight, cos, sin, self.k_norm.eps)  # [B, N, Hkv, D]
        else:
            q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        if packed is not None:  # x holds only the valid tokens [1, N, H]: pad them to [B, C] for the attention op
            q, k, v = (packed.unpack(t[0]) for t in (q, k, v))  # [B, C, Hq | Hkv, D]
        o = block_attention(q, k, v, k_cache, v_cache, cache_lens, chunk_lens, block_size,
                            check_lengths=False)  # [B, C, Hq, D]
        if packed is not None:
            o = packed.pack(o)  # [1, N, Hq, D]
        return _decode_linear(o.reshape(*o.shape[:2], self.hq * self.d), self.o_proj.weight)  # [B, C, H]


class _Packing(NamedTuple):
    """Where the tokens of a cached forward's [1, N] packed layout sit in its [B, C] chunk (rows' valid tokens back
    to back in row order). Slot t is chunk position (rows[t], cols[t]); a slot past the valid tokens (a static
    capacity larger than their count) has rows[t] == B, a spare row of the padded buffers (cols[t] = t mod C, so
    that padding slots rarely share a target), and reads row B - 1 at that column."""

    rows: torch.Tensor  # [N] int64 in [0, B]
    cols: torch.Tensor  # [N] int64 in [0, C)
    shape: tuple[int, int]  # (B, C)

    @staticmethod
    def dynamic(chunk_lens: torch.Tensor, c: int) -> "_Packing | None":
        """Exactly the valid tokens (reads their count on the host); None when every row is full."""
        valid = torch.arange(c, device=chunk_lens.device)[None] < chunk_lens.to(torch.int64)[:, None]  # [B, C]
        if bool(valid.all()):
            return None
        rows, cols = valid.nonzero(as_tuple=True)
        return _Packing(rows, cols, (chunk_lens.shape[0], c))

    @staticmethod
    def static(chunk_lens: torch.Tensor, c: int, capacity: int) -> "_Packing":
        """`capacity` slots whatever the lengths (no host read: a CUDA graph can hold it). The caller guarantees
        sum(chunk_lens) <= capacity; tokens past it would be dropped."""
        b = chunk_lens.shape[0]
        lens = chunk_lens.to(torch.int64).clamp(0, c)  # [B]
        ends = lens.cumsum(0)  # [B] one past each row's last slot
        slot = torch.arange(capacity, device=chunk_lens.device)  # [N]
        rows = torch.searchsorted(ends, slot, right=True)  # [N] the row whose span holds the slot; B past them all
        first = (ends - lens)[rows.clamp_max(b - 1)]  # [N] that row's first slot
        cols = torch.where(rows < b, slot - first, slot % c)  # [N]
        return _Packing(rows, cols, (b, c))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """[B, C, ...] -> [1, N, ...] (padding slots read row B - 1)."""
        return t[self.rows.clamp_max(self.shape[0] - 1), self.cols][None]

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, C, ...], zeros where no token sits (padding slots land in the spare row, dropped)."""
        out = t.new_zeros((self.shape[0] + 1, self.shape[1], *t.shape[1:]))
        out[self.rows, self.cols] = t
        return out[: self.shape[0]]


class MLP(nn.Module):
    def __init__(self, cfg: SDARConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def _projections(self) -> list[nn.Linear]:
        return [self.gate_proj, self.up_proj]

    def forward_cached(self, x: torch.Tensor) -> torch.Tensor:
        """The same MLP; gate and up in one GEMM when their weights are packed, then `ops.silu_mul` on CUDA."""
        w = packed_weight(self._projections())
        if w is None:
            return self(x)
        gate_up = _decode_linear(x, w)  # [B, N, 2 I]: gate and up side by side
        if gate_up.is_cuda:
            return _decode_linear(silu_mul(gate_up), self.down_proj.weight)  # silu_mul: [B, N, I] in one launch
        gate, up = gate_up.chunk(2, dim=-1)  # [B, N, I] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: SDARConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, layout, plan) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layout, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class SDARModel(nn.Module):
    def __init__(self, cfg: SDARConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class KVCache:
    """Preallocated static-shape cache: k, v [layers, batch, capacity, kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, cfg: SDARConfig, batch: int, capacity: int, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> "KVCache":
        if capacity <= 0 or capacity % cfg.block_size:
            raise ValueError(f"KV cache capacity {capacity} must be a positive multiple of block_size {cfg.block_size}")
        if batch <= 0:
            raise ValueError(f"KV cache batch must be positive, got {batch}")
        shape = (cfg.num_hidden_layers, batch, capacity, cfg.num_key_value_heads, cfg.head_dim)
        dtype = dtype or cfg.dtype
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class SDARForCausalLM(nn.Module):
    """SDAR block-diffusion LM. `gradient_checkpointing = True` recomputes each layer in backward."""

    def __init__(self, cfg: SDARConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = SDARModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False

    # -- parameters ---------------------------------------------------------------------------------
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> "SDARForCausalLM":
        """Random init (normal(0, std) matrices, unit norms) for tests and from-scratch models."""
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype) * std)
        return self

    def pack_decode_weights(self) -> "SDARForCausalLM":
        """Pack each layer's q/k/v and gate/up weights for the cached forward (see the module docstring): one
        copy of those weights the first time, a pointer check after that."""
        for layer in self.model.layers:
            pack_linears(layer.self_attn._projections())
            pack_linears(layer.mlp._projections())
        return self

    def forward_weight_bytes(self) -> int:
        """Bytes of weights one decode forward reads: every parameter once (a tied LM head counted once, as the
        LM head reads it whole), except an untied embedding table, of which a forward gathers a few rows."""
        emb = self.model.embed_tokens.weight
        total = 0
        for p in {id(p): p for p in self.parameters()}.values():
            if p is emb and not self.config.tie_word_embeddings:
                continue
            total += p.numel() * p.element_size()
        return total

    def state_dict_for_save(self) -> dict[str, torch.Tensor]:
        """state_dict with the tied lm_head omitted (the SDAR/HF convention)."""
        sd = self.state_dict()
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd

    # -- full-sequence forward ------------------------------------------------------------------------
    def _check_ids(self, input_ids: torch.Tensor, check_values: bool | None = None) -> None:
        """input_ids: an int32/int64 [batch, length] tensor on the model's device; with `check_values` (None = for
        CPU ids, where it costs no device sync), every id in [0, vocab_size). nn.Embedding would fail on an id out
        of range with an IndexError that names neither, or on CUDA with a device-side assert that ends the
        process's CUDA context."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be an int [batch, length] tensor, got "
                             f"{getattr(input_ids, 'dtype', type(input_ids))} {tuple(getattr(input_ids, 'shape', ()))}")
        dev = self.model.embed_tokens.weight.device
        if input_ids.device != dev:
            raise ValueError(f"input_ids is on {input_ids.device} but the model is on {dev}")
        vocab = self.config.vocab_size
        if check_values is None:
            check_values = input_ids.device.type == "cpu"
        if check_values and input_ids.numel():
            lo, hi = torch.stack([input_ids.min(), input_ids.max()]).tolist()
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(f"input_ids has token id {bad} outside the vocabulary [0, {vocab})")

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
               layout: MaskLayout | PackedLayout | None = None, check_ids: bool | None = None) -> torch.Tensor:
        """Final normalized hidden states [B, N, H] under `layout` (None = block-causal over N with the
        config's block size; a layout carries its own block size; a PackedLayout needs position_ids).
        position_ids: int [B, N] on input_ids' device. `check_ids`: check that the ids lie in the vocabulary
        (ValueError); None = for CPU ids only: on CUDA it would be a host sync per forward, which the trainer's
        micro-batch loop avoids (its ids come from the sampler and the tokenizer), so there pass True to check."""
        self._check_ids(input_ids, check_ids)
        bsz, n = input_ids.shape
        cfg = self.config
        if layout is None:
            layout = MaskLayout.block_causal(n, cfg.block_size)
        if position_ids is None and isinstance(layout, PackedLayout):
            raise ValueError("a PackedLayout needs position_ids (each segment's own positions)")
        if position_ids is None:
            position_ids = torch.arange(layout.n, device=input_ids.device).repeat(layout.num_copies).expand(bsz, n)
        check_tensor("position_ids", position_ids, dtypes=(torch.int32, torch.int64), device=input_ids.device)
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} != input_ids shape {tuple(input_ids.shape)}")
        x = self.model.embed_tokens(input_ids)  # [B, N, H]
        cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, x.dtype)
        plan = prepare(layout, bsz, x.device)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, layout, plan, use_reentrant=False)
            else:
                x = layer(x, cos, sin, layout, plan)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                layout: MaskLayout | PackedLayout | None = None, check_ids: bool | None = None) -> torch.Tensor:
        """Logits [B, N, V] (see `hidden`)."""
        return self.lm_head(self.hidden(input_ids, position_ids, layout, check_ids))

    # -- incremental forward against the KV cache ----------------------------------------------------------
    def hidden_cached(self, input_ids: torch.Tensor, cache: KVCache, cache_lens: torch.Tensor,
                      chunk_lens: torch.Tensor, block_size: int | None = None,
                      check_lengths: bool | None = None, token_capacity: int | None = None) -> torch.Tensor:
        """Hidden states [B, C, H] of a chunk per row at positions cache_lens + arange(C) (past chunk_lens: zeros when
        packed, else what the padding tokens compute; never read by the sampler).

        Writes the chunk's K/V into `cache` (rows' first chunk_lens[b] tokens); lengths are not advanced.
        `block_size` overrides the config's (decoding a checkpoint with another block size).
        cache_lens, chunk_lens: [B] int32 on the model's device; `cache` holds the model's layers, kv heads and
        head_dim in the model's dtype.
        `check_lengths`: validate the lengths and the token ids once on the host (one device sync for CUDA
        tensors; None = unless a CUDA graph is being captured or torch.compile traces; CPU ids are checked
        always). The sampler, which builds them, passes False.
        `token_capacity`: run the projections, norms and MLP on this many token slots: the rows' valid tokens
        back to back, then padding (the attention op still sees [B, C]). Shapes stay static (no host read: a CUDA
        graph can hold it), and padding tokens of the [B, C] chunk cost no GEMM work. The caller guarantees
        sum(chunk_lens) <= token_capacity (checked with `check_lengths`); >= B x C means no packing. None: on the
        CPU exactly the valid tokens (their count read on the host), on CUDA the whole [B, C] chunk.
        """
        block_size = self.config.block_size if block_size is None else check_int("block_size", block_size, lo=1)
        if token_capacity is not None:
            token_capacity = check_int("token_capacity", token_capacity, lo=1)
        if check_lengths is None:
            check_lengths = host_checks_allowed(input_ids.device) if isinstance(input_ids, torch.Tensor) else False
        self._check_ids(input_ids, True if check_lengths else None)  # CPU ids are checked either way (no sync)
        bsz, c = input_ids.shape
        self._check_cache(cache)
        if bsz != cache.batch:
            raise ValueError(f"input_ids batch {bsz} != KV cache batch {cache.batch}")
        for name, t in (("cache_lens", cache_lens), ("chunk_lens", chunk_lens)):
            check_tensor(name, t, shape=(bsz,), dtypes=(torch.int32,), device=input_ids.device)
        if check_lengths:
            check_cache_lengths(cache_lens, chunk_lens, c, cache.capacity)
            if token_capacity is not None and int(chunk_lens.sum()) > token_capacity:
                raise ValueError(f"chunk_lens sum to {int(chunk_lens.sum())} tokens, more than token_capacity "
                                 f"{token_capacity}")
        position_ids = cache_lens.to(torch.int64)[:, None] + torch.arange(c, device=input_ids.device)  # [B, C]
        if token_capacity is not None:
            packed = _Packing.static(chunk_lens, c, token_capacity) if token_capacity < bsz * c else None
        else:  # CPU: exactly the valid tokens; CUDA: static [B, C] (the attention kernel skips the padding itself)
            packed = None if input_ids.is_cuda else _Packing.dynamic(chunk_lens, c)
        if packed is not None:
            input_ids, position_ids = packed.pack(input_ids), packed.pack(position_ids)  # [1, N]
        x = self.model.embed_tokens(input_ids)  # [B, C, H] (or [1, N, H] packed)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        # each residual add is fused with the norm after it (the next layer's input norm, the final norm last)
        layers = self.model.layers
        h = _decode_norm(layers[0].input_layernorm, x)  # [B, C, H] normalized; x stays the residual stream
        for i, layer in enumerate(layers):
            a = layer.self_attn.forward_cached(h, cos, sin, cache.k[i], cache.v[i], cache_lens, chunk_lens,
                                               block_size, packed)  # [B, C, H]
            h, x = _decode_add_norm(layer.post_attention_layernorm, a, x)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, x = _decode_add_norm(nxt, layer.mlp.forward_cached(h), x)
        return packed.unpack(h[0]) if packed is not None else h

    def _check_cache(self, cache: KVCache) -> None:
        """`cache` is a KVCache whose k and v are [layers, batch, capacity, kv_heads, head_dim] of this model, on
        its device (a cache of another model failed deep inside, or indexed past its layers). Its dtype is checked
        against the activations' by ops.block_attention."""
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
        cfg, dev = self.config, self.model.embed_tokens.weight.device
        want = (cfg.num_hidden_layers, None, None, cfg.num_key_value_heads, cfg.head_dim)
        check_tensor("cache.k", cache.k, shape=want, device=dev)
        check_tensor("cache.v", cache.v, shape=tuple(cache.k.shape), dtypes=(cache.k.dtype,), device=dev)

    def forward_cached(self, input_ids: torch.Tensor, cache: KVCache, cache_lens: torch.Tensor,
                       chunk_lens: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
        """Logits [B, C, V] of a chunk against the cache (see `hidden_cached`)."""
        return self.decode_logits(self.hidden_cached(input_ids, cache, cache_lens, chunk_lens, block_size))

    def decode_logits(self, h: torch.Tensor) -> torch.Tensor:
        """lm_head of the decode forward: [..., H] -> [..., V] through ops.linear (`_decode_linear`)."""
        return _decode_linear(h, self.lm_head.weight)


def build_model(cfg: SDARConfig, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                seed: int | None = 0) -> SDARForCausalLM:
    """A randomly initialized model (tests, from-scratch training)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    model = SDARForCausalLM(cfg).init_weights(generator=gen)
    return model.to(device=device, dtype=dtype or cfg.dtype)
