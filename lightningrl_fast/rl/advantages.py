"""[score -> advantages] Rewards, TPF-aware group filtering and per-reward decoupled normalization.

Rewards per sample (REFERENCE §4): accuracy a in {0, 1} from the task's verifier (a response that hit
max_new_tokens without EOS counts as wrong) and speed s = TPF. A group (the G samples of one prompt) is
dropped when every sample is wrong (no signal for accuracy, and NLL has nothing to imitate) or when its
TPF spread max - min < `min_tpf_range` (no signal for speed). Advantages: `ops.group_normalize` with
weights (1, w_tpf), decoupled (z-score each reward within the group, then sum, then batch z-score) or
"sum" (the ablation: sum the raw rewards first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.grpo_loss import group_normalize


@dataclass
class Scored:
    """Rewards of a set of samples, G per prompt, grouped by `group_ids`."""

    accuracy: torch.Tensor  # [S] float {0, 1}
    tpf: torch.Tensor  # [S] float
    group_ids: torch.Tensor  # [S] int64

    def rewards(self) -> torch.Tensor:
        return torch.stack([self.accuracy, self.tpf], dim=1)  # [S, 2]


def score_rollout(correct: list[bool], tpf: torch.Tensor, eos_found: torch.Tensor, group_ids: torch.Tensor) -> Scored:
    """Accuracy (verifier-correct AND finished with EOS) and TPF per sample."""
    acc = torch.tensor(correct, dtype=torch.float32) * eos_found.float()
    return Scored(acc, tpf.float(), group_ids)


def keep_groups(sc: Scored, min_tpf_range: float = 0.01, drop_all_wrong: bool = True) -> torch.Tensor:
    """[S] bool: samples of the groups that carry a learning signal (TPF-aware filtering)."""
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
    """[S] float32 advantages (one per sample, broadcast to its tokens by the caller)."""
    weights = torch.tensor([1.0, tpf_weight])
    return group_normalize(sc.rewards(), sc.group_ids, weights, mode)
