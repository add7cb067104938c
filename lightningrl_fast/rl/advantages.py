"""[score -> advantages] Rewards, TPF-aware group filtering and per-reward decoupled normalization.

Rewards per sample (REFERENCE §4): accuracy a in {0, 1} from the task's verifier (a response that hit
max_new_tokens without EOS counts as wrong) and speed s = TPF. A group (the G samples of one prompt) is
dropped when every sample is wrong (no signal for accuracy, and NLL has nothing to imitate) or when its
TPF spread max - min < `min_tpf_range` (no signal for speed). Advantages: `ops.group_normalize` with
weights (1, w_tpf), decoupled (z-score each reward within the group, then sum, then batch z-score) or
"sum" (the ablation: sum the raw rewards first).
Every entry point checks its `Scored` (`check_scored`: one length, finite values, integer group ids), so a
mismatched or NaN reward is an error naming it, never a broadcast value or a silently dropped group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops._common import check_float, check_tensor
from ..ops.grpo_loss import group_normalize


@dataclass
class Scored:
    """Rewards of a set of samples, G per prompt, grouped by `group_ids`."""

    accuracy: torch.Tensor  # [S] float {0, 1}
    tpf: torch.Tensor  # [S] float
    group_ids: torch.Tensor  # [S] int64

    def rewards(self) -> torch.Tensor:
        return torch.stack([self.accuracy, self.tpf], dim=1)  # [S, 2]


_REAL = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
         torch.float32, torch.float64)


def check_scored(sc: Scored) -> int:
    """The number of samples S of `sc`: accuracy and tpf [S] real, group_ids [S] int, on one device, all finite
    (a NaN TPF would silently drop its group in `keep_groups`). One host read (the rewards live on the host)."""
    if not isinstance(sc, Scored):
        raise TypeError(f"expected a Scored, got {type(sc).__name__}")
    check_tensor("Scored.accuracy", sc.accuracy, ndim=1, dtypes=_REAL)
    s = sc.accuracy.shape[0]
    check_tensor("Scored.tpf", sc.tpf, shape=(s,), dtypes=_REAL, device=sc.accuracy.device)
    check_tensor("Scored.group_ids", sc.group_ids, shape=(s,), device=sc.accuracy.device)
    if s and sc.group_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"Scored.group_ids must have dtype in (int32, int64), got "
                        f"{str(sc.group_ids.dtype).replace('torch.', '')}")
    for name in ("accuracy", "tpf"):
        if s and not bool(torch.isfinite(getattr(sc, name).float()).all()):
            raise ValueError(f"Scored.{name} contains NaN or inf")
    return s


def score_rollout(correct: list[bool], tpf: torch.Tensor, eos_found: torch.Tensor, group_ids: torch.Tensor) -> Scored:
    """Accuracy (verifier-correct AND finished with EOS) and TPF per sample: correct [S] (bools), tpf [S],
    eos_found [S] bool, group_ids [S] int."""
    check_tensor("tpf", tpf, ndim=1, dtypes=_REAL)
    s = tpf.shape[0]
    check_tensor("eos_found", eos_found, shape=(s,), dtypes=(torch.bool,))
    if len(correct) != s:
        raise ValueError(f"correct has {len(correct)} entries but tpf has {s} samples")
    bad = [c for c in correct if isinstance(c, (str, bytes)) or c not in (0, 1)]  # bools (numpy's too), 0 / 1
    if bad:
        raise TypeError(f"correct must hold booleans, got {bad[0]!r}")
    acc = torch.tensor([bool(c) for c in correct], dtype=torch.float32).to(eos_found.device) * eos_found.float()
    sc = Scored(acc, tpf.float(), group_ids)
    check_scored(sc)
    return sc


def keep_groups(sc: Scored, min_tpf_range: float = 0.01, drop_all_wrong: bool = True) -> torch.Tensor:
    """[S] bool: samples of the groups that carry a learning signal (TPF-aware filtering)."""
    min_tpf_range = check_float("min_tpf_range", min_tpf_range)
    if check_scored(sc) == 0:
        return torch.zeros(0, dtype=torch.bool, device=sc.accuracy.device)
    _, inv = torch.unique(sc.group_ids, return_inverse=True)
    ng = int(inv.max()) + 1
    any_right = torch.zeros(ng).scatter_reduce(0, inv, sc.accuracy.float(), "amax")
    tmax = torch.full((ng,), -float("inf")).scatter_reduce(0, inv, sc.tpf.float(), "amax")
    tmin = torch.full((ng,), float("inf")).scatter_reduce(0, inv, sc.tpf.float(), "amin")
    good = (tmax - tmin) >= min_tpf_range
    if drop_all_wrong:
        good &= any_right > 0
    return good[inv]


def compute_advantages(sc: Scored, tpf_weight: float = 1.0, mode: str = "decoupled") -> torch.Tensor:
    """[S] advantages (one per sample, broadcast to its tokens by the caller): float64 for float64 rewards,
    float32 otherwise. The weights take the rewards' dtype and device (a float32 w_tpf would round float64 rewards'
    advantages to float32 accuracy); integer or bool rewards count as float32."""
    check_scored(sc)
    rewards = sc.rewards()
    if not rewards.is_floating_point():
        rewards = rewards.float()
    weights = torch.tensor([1.0, check_float("tpf_weight", tpf_weight)], dtype=rewards.dtype, device=rewards.device)
    return group_normalize(rewards, sc.group_ids, weights, mode)
