"""Advantage estimators as small pure tensor functions (ALGORITHMS.md items 27-30, 38, 39).

Conventions pinned here (and tested in tests/test_advantages_math.py):

* Rewards are ``(N,)`` with groups as consecutive runs of ``G`` rows (TRL's layout); ``NaN`` marks a row no reward
  function could score. Such rows are left out of every baseline and mean, and get advantage 0.
* Token tensors are ``(B, T)``, right-padded, with a float/bool ``mask`` (1 = completion token).
* Whitening is over valid tokens of the *global* batch with the unbiased (N-1) variance and
  ``(x - mean) / sqrt(var + 1e-8)`` (verl's ``masked_whiten``); ``reduce`` sums a tensor over ranks (``None``: one
  process), so the same function gives the same numbers on one or many processes.
* Rows a ``trl_ext_filter_groups`` plugin dropped stay in the batch (masked afterwards); a statistic over the whole
  batch leaves them out: :func:`drop_filtered_rows` marks their rewards unscorable (NaN), :func:`kept_token_mask`
  removes their tokens from a token mask (see ``RolloutBatch.keep``).
* KL estimators per sampled token with ``d = log pi - log pi_ref``: k1 = d, k2 = d^2/2, k3 = e^-d - 1 + d.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor] | None
WHITEN_EPS = 1e-8
AREAL_WHITEN_EPS = 1e-5  # AReaL's Normalization adds it to the std
Whitening = Literal["verl", "openrlhf", "areal", "none"]


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size}")
    return rewards.view(-1, group_size)


# -- rows a filter dropped --------------------------------------------------------------------------------------------


def drop_filtered_rows(rewards: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``rewards`` with the rows ``keep`` (bool, same rows) leaves out marked unscorable (NaN): every baseline, mean,
    std and normalisation below already skips NaN rows and gives them 0, so a filtered row then counts in no
    statistic of the batch, as if it had been removed (verl, slime). ``keep=None``: ``rewards`` unchanged."""
    if keep is None:
        return rewards
    return torch.where(keep.to(rewards.device), rewards, torch.full_like(rewards, float("nan")))


def kept_token_mask(mask: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Token ``mask`` ``(B, T)`` with the tokens of rows ``keep`` (``(B,)`` bool) leaves out set to 0, so a token-level
    statistic (whitening, a token mean) runs over the kept rows only. ``keep=None``: ``mask`` unchanged."""
    if keep is None:
        return mask
    return torch.where(keep.to(mask.device).unsqueeze(-1), mask, torch.zeros_like(mask))


# -- sequence-level baselines ----------------------------------------------------------------------------------------


def rloo_advantages(rewards: torch.Tensor, group_size: int, normalize: bool = False) -> torch.Tensor:
    """Leave-one-out: ``A_k = R_k - mean_{j != k} R_j`` over the *scorable* siblings (RLOO, arXiv 2402.14740).

    Same NaN policy as TRL's RLOOTrainer: unscorable rows, and a row whose group has no other scorable row, get 0.
    ``normalize``: then ``(A - mean) / (std + 1e-4)`` over the rows with a defined advantage (unbiased std), as
    ``RLOOConfig.normalize_advantages``. ``group_size`` (K) must be >= 2: with one sample there is no baseline.
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs at least 2 samples per prompt (num_generations >= 2), got {group_size}")
    grouped = _grouped(rewards, group_size)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    advantages = (grouped - (total - grouped) / (scorable - 1)).reshape(-1)
    if normalize:
        defined = advantages[~torch.isnan(advantages)]
        advantages = (advantages - defined.mean()) / (defined.std() + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def _group_std(grouped: torch.Tensor, valid: torch.Tensor, std: str) -> torch.Tensor:
    """Per-row std of each group's scorable rewards: ``sample`` (N-1), ``population`` (N), or ``leave_one_out`` (the
    sample std of the *other* scorable rows of the group). Undefined stds (too few rows) are 0."""
    zero = torch.zeros((), dtype=grouped.dtype, device=grouped.device)
    if std == "leave_one_out":
        g = grouped.shape[1]
        others = valid.unsqueeze(1) & ~torch.eye(g, dtype=torch.bool, device=grouped.device)  # (groups, row, other)
        values = grouped.unsqueeze(1).expand(-1, g, -1)
        count = others.sum(-1)
        mean = torch.where(others, values, zero).sum(-1) / count.clamp(min=1)
        squares = torch.where(others, (values - mean.unsqueeze(-1)) ** 2, zero).sum(-1)
        return torch.sqrt(squares / (count - 1).clamp(min=1))
    count = valid.sum(-1, keepdim=True)
    mean = torch.where(valid, grouped, zero).sum(-1, keepdim=True) / count.clamp(min=1)
    squares = torch.where(valid, (grouped - mean) ** 2, zero).sum(-1, keepdim=True)
    dof = count - 1 if std == "sample" else count
    return torch.sqrt(squares / dof.clamp(min=1)).expand_as(grouped)


GROUP_STDS = ("sample", "population", "leave_one_out")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", std: str = "sample",
                     baseline: str = "mean", eps: float = 1e-4, single_sample: str = "zero",
                     zero_std: str = "epsilon") -> torch.Tensor:
    """Group-relative advantages ``(R - b) / (s + eps)`` (GRPO, arXiv 2402.03300), every peer convention a switch.

    ``baseline``: ``mean`` (the group mean, GRPO/TRL/verl) or ``leave_one_out`` (the mean of the other rows, RLOO-style).
    ``scale``: ``group`` (s = the group's std; TRL ``scale_rewards="group"``, verl), ``batch`` (s = the std of the
    whole gathered batch, centre still per group; TRL ``scale_rewards="batch"``), ``none`` (no division; Dr. GRPO).
    ``std``: ``sample`` (unbiased N-1, torch.std: TRL, verl), ``population`` (N), ``leave_one_out`` (the sample std of
    the other rows; group scale only). ``eps``: added to s (TRL 1e-4, verl 1e-6). ALGORITHMS.md convention 1:
    rewards [1, 0, 0, 0] give 1.5 (sample std) vs 1.732 (population) for the top row with eps 0.
    Unscorable rows (NaN) are left out of every statistic and get 0; a zero-variance group gives 0 for every row.
    ``single_sample`` (G = 1): ``zero`` (TRL: R - mean = 0) or ``raw`` (verl: mean 0, std 1, so A = R / (1 + eps)).
    ``zero_std``: where s is 0, ``epsilon`` divides by eps alone (TRL, verl; with eps 0 nothing is divided there, so
    the result stays finite) and ``skip`` does not divide (NeMo-RL: A = R - b). They differ only where R - b is
    nonzero with s = 0: under ``std: leave_one_out`` a row whose peers tie (binary [1, 0, 0, 0]: 0.75 / eps against
    NeMo-RL's 1 with its leave-one-out baseline).
    """
    if group_size == 1 and single_sample == "raw":
        return torch.nan_to_num(rewards / (1.0 + eps), nan=0.0)
    grouped = _grouped(rewards, group_size)
    valid = ~torch.isnan(grouped)
    zero = torch.zeros((), dtype=grouped.dtype, device=grouped.device)
    filled = torch.where(valid, grouped, zero)
    count = valid.sum(-1, keepdim=True)
    total = filled.sum(-1, keepdim=True)
    if baseline == "mean":
        centre = total / count.clamp(min=1)
    elif baseline == "leave_one_out":
        centre = (total - filled) / (count - 1).clamp(min=1)
    else:
        raise ValueError(f"unknown baseline {baseline!r}; choose mean or leave_one_out")
    out = grouped - centre
    if baseline == "leave_one_out":
        # a row with no other scorable row in its group has no baseline: 0 (RLOO, TRL's RLOOTrainer), not R / eps
        out = torch.where(count > 1, out, zero)
    if scale == "group":
        out = _divide_by_std(out, _group_std(grouped, valid, std), eps, zero_std)
    elif scale == "batch":
        if std == "leave_one_out":
            raise ValueError("std: leave_one_out needs scale: group")
        flat, flat_valid = grouped.reshape(1, -1), valid.reshape(1, -1)
        out = _divide_by_std(out, _group_std(flat, flat_valid, std).reshape(grouped.shape), eps, zero_std)
    elif scale != "none":
        raise ValueError(f"unknown scale {scale!r}; choose group, batch or none")
    return torch.where(valid, out, zero).reshape(-1)


def _divide_by_std(centred: torch.Tensor, s: torch.Tensor, eps: float, zero_std: str) -> torch.Tensor:
    """``centred / (s + eps)``, left undivided where the rule says not to divide (see :func:`group_advantages`)."""
    if zero_std == "epsilon":
        divide = (s + eps) > 0
    elif zero_std == "skip":
        divide = s > 0
    else:
        raise ValueError(f"unknown zero_std {zero_std!r}; choose epsilon or skip")
    one = torch.ones((), dtype=s.dtype, device=s.device)
    return torch.where(divide, centred / torch.where(divide, s + eps, one), centred)


def group_mean_baseline(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-prompt mean reward (scorable rows only), repeated for each row of the group."""
    return torch.nanmean(_grouped(rewards, group_size), dim=1, keepdim=True).expand(-1, group_size).reshape(-1)


def batch_mean_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """Mean reward of the whole (gathered) batch, scorable rows only, as a ``(N,)`` tensor."""
    return torch.nanmean(rewards).expand_as(rewards)


def ema_update(previous: float, rewards: torch.Tensor, decay: float) -> float:
    """Moving-average baseline update ``b <- decay * b + (1 - decay) * mean(R)`` (scorable rows only)."""
    mean = torch.nanmean(rewards)
    return previous if torch.isnan(mean) else decay * previous + (1 - decay) * mean.item()


def baseline_advantages(rewards: torch.Tensor, baseline: torch.Tensor | float) -> torch.Tensor:
    """REINFORCE with a baseline: ``A = R - b``; unscorable rows get 0."""
    return torch.nan_to_num(rewards - baseline, nan=0.0)


def remax_advantages(rewards: torch.Tensor, greedy_rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """ReMax (arXiv 2310.10505): ``A = R(x, y) - R(x, y_greedy(x))``; ``greedy_rewards`` holds one value per prompt
    (per group of ``group_size`` rows). Unscorable rows (either side) get 0."""
    grouped = _grouped(rewards, group_size)
    if greedy_rewards.shape != (grouped.shape[0],):
        raise ValueError(f"expected one greedy reward per prompt ({grouped.shape[0]}), got {tuple(greedy_rewards.shape)}")
    return torch.nan_to_num(grouped - greedy_rewards.to(grouped.dtype).unsqueeze(1), nan=0.0).view(-1)


# -- token-level pieces ----------------------------------------------------------------------------------------------


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k1",
                clamp: float | None = None) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled-token log-probs; ``estimator`` in ``KL_ESTIMATORS``
    (:func:`trl_ext.ops.kl_estimate`: k3's exponent is clamped to +-20, so extreme log-ratios stay finite);
    ``clamp``: optionally clamp the estimate to [-clamp, clamp] (verl clamps its KL penalty to +-10 for k3)."""
    from trl_ext import ops

    return ops.kl_estimate(logps, ref_logps, estimator, clamp)


def masked_token_kl(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, estimator: str = "k1",
                    clamp: float | None = None) -> torch.Tensor:
    """:func:`kl_estimate` on the valid tokens of ``mask``, exactly 0 elsewhere (``where`` before the estimate, so
    -inf log-probs at padding cannot produce NaN). The per-token KL that every KL-in-the-reward form starts from."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=logps.dtype, device=logps.device)
    kl = kl_estimate(torch.where(valid, logps, zero), torch.where(valid, ref_logps.to(logps.dtype), zero), estimator,
                     clamp)
    return torch.where(valid, kl, zero)


def sequence_kl_rewards(rewards: torch.Tensor, sequence_kl: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Sequence-level KL in the reward: ``R - kl_coef * sum_t KL_t`` per row (TRL RLOOTrainer, verl's RLOO on
    ``token_level_rewards.sum(-1)``); ``sequence_kl`` holds the per-row sums. Unscorable rows (NaN) stay NaN."""
    return rewards - kl_coef * sequence_kl.to(rewards.dtype)


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """1 at the last valid token of each row (rows with no token get none). The mask may have interior gaps (tool or
    observation tokens of a multi-turn completion): the last *valid* token is found by position, not by count."""
    mask = mask.to(torch.float64 if mask.dtype == torch.float64 else torch.float32)
    valid = mask > 0
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(-1).values
    out = torch.zeros_like(mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = 1
    return out


def token_rewards(sequence_rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """RLHF per-token rewards ``r_t = 1[t = last valid] * R - kl_coef * KL_t`` on valid tokens, 0 elsewhere."""
    out = last_token_mask(mask).to(sequence_rewards.dtype) * sequence_rewards.unsqueeze(-1)
    if kl is not None and kl_coef:
        out = out - kl_coef * kl.to(out.dtype)
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float | torch.Tensor = 0.95, bootstrap: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015, arXiv 1506.02438) over masked sequences.

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, where *next* is the next
    valid token of the row and ``V``/``A`` after the last valid token are 0. Invalid tokens (padding, and tool or
    observation tokens inside a multi-turn completion) are skipped, not treated as the end of the episode: values and
    the running advantage carry across the gap and the gap costs no discount step (verl's multi-turn GAE). ``lam`` is a
    float or a ``(B,)``/``(B, 1)`` tensor (length-adaptive lambda). ``bootstrap``: ``(B,)`` values of the state
    after each row's last valid token, for rows cut off before the episode ended (a truncated completion: AReaL's
    bootstrap, Pardo et al. 2018's time-limit rule, arXiv 1712.00378); ``None`` or 0 ends every row as a terminal
    state. Returns ``(advantages, returns)`` with ``returns = A + V``; both are 0 on invalid tokens. Rewards on
    invalid tokens are ignored.
    """
    valid = mask.bool()
    lam_t = torch.as_tensor(lam, dtype=rewards.dtype, device=rewards.device)
    if lam_t.dim() == 1:
        lam_t = lam_t.unsqueeze(-1)
    lam_t = lam_t.expand(rewards.shape[0], 1) if lam_t.dim() else lam_t
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    values = torch.where(valid, values.to(rewards.dtype), zero)
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, :1])  # A at the next valid token (0 after the last)
    next_value = torch.zeros_like(running)  # V at the next valid token (after the last: 0, or the bootstrap value)
    if bootstrap is not None:
        next_value = bootstrap.to(rewards.dtype).reshape(-1, 1).expand_as(next_value).clone()
    for t in reversed(range(rewards.shape[1])):
        here = valid[:, t : t + 1]
        delta = rewards[:, t : t + 1] + gamma * next_value - values[:, t : t + 1]
        running = torch.where(here, delta + gamma * lam_t * running, running)
        next_value = torch.where(here, values[:, t : t + 1], next_value)
        advantages[:, t : t + 1] = torch.where(here, running, zero)
    return advantages, torch.where(valid, advantages + values, zero)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = sum_{s >= t} gamma^(s-t) r_s`` over the valid tokens of each sequence (GAE with V = 0 and lambda = 1):
    invalid interior tokens are skipped (the return carries across them, undiscounted), not episode ends."""
    return gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[0]


def remax_token_advantages(rewards: torch.Tensor, baselines: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor,
                           kl_coef: float) -> torch.Tensor:
    """ReMax with the KL in the token rewards (verl's ``compute_remax_outcome_advantage``): ``A_t = G_t - b`` with
    ``G_t = sum_{s >= t} r_s``, ``r_s = 1[s = last] * R - kl_coef * KL_s`` and ``b`` the greedy completion's reward.
    ``rewards``, ``baselines``: ``(B,)`` (one baseline per row); rows where either is NaN (unscorable) get 0, as
    :func:`remax_advantages`; 0 off the mask. Returns ``(B, T)``."""
    defined = ~(torch.isnan(rewards) | torch.isnan(baselines))
    per_token = token_rewards(torch.nan_to_num(rewards), mask, kl, kl_coef)
    out = discounted_returns(per_token, mask, 1.0) - torch.nan_to_num(baselines).to(per_token.dtype).unsqueeze(-1)
    return torch.where(mask.bool() & defined.unsqueeze(-1), out, torch.zeros_like(out))


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float = 0.05) -> torch.Tensor:
    """VAPO's policy lambda ``1 - 1/(alpha * l)`` (arXiv 2504.05118), with ``alpha * l`` clamped to >= 1 so lambda is
    in [0, 1] (NeMo-RL's convention)."""
    scaled = (alpha * lengths.to(torch.float64)).clamp(min=1.0)
    return (1.0 - 1.0 / scaled).clamp(0.0, 1.0)


# -- global-batch statistics -----------------------------------------------------------------------------------------


def _sum(t: torch.Tensor, reduce: Reduce) -> torch.Tensor:
    return t if reduce is None else reduce(t)


def masked_moments(values: torch.Tensor, mask: torch.Tensor, reduce: Reduce = None,
                   ddof: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of ``values`` over ``mask`` across all ranks (two passes for accuracy); the variance divides
    by ``n - ddof`` (1: unbiased, the default; 0: the population variance)."""
    valid, mask = mask.bool(), mask.to(values.dtype)
    values = torch.where(valid, values, torch.zeros_like(values))  # where, not a product: -inf/NaN off-mask stay out
    totals = _sum(torch.stack([values.sum(), mask.sum()]), reduce)
    mean = totals[0] / totals[1].clamp(min=1.0)
    squares = _sum(torch.where(valid, (values - mean) ** 2, torch.zeros_like(values)).sum(), reduce)
    var = squares / (totals[1] - ddof).clamp(min=1.0)
    return mean, var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, reduce: Reduce = None,
                  convention: Whitening = "verl") -> torch.Tensor:
    """Whiten over the valid tokens of the global batch; padding stays 0. ``verl`` (masked_whiten):
    ``(x - mean) / sqrt(var + 1e-8)`` with the unbiased variance (divided by n - 1); ``openrlhf`` (its experience
    maker, also NeMo-RL's): ``(x - mean) / sqrt(max(var, 1e-8))`` with the population variance (divided by n). They
    differ by a factor ``sqrt((n - 1) / n)`` (and near zero variance). ``areal`` (AReaL's ``Normalization``):
    ``(x - mean) / (std + 1e-5)`` with the unbiased std. ``none``: the values as they are (slime's default
    ``--normalize-advantages`` off), padding still 0."""
    if convention == "none":
        return torch.where(mask.bool(), values, torch.zeros_like(values))
    if convention == "areal":
        mean, var = masked_moments(values, mask, reduce)
        return torch.where(mask.bool(), (values - mean) / (var.sqrt() + AREAL_WHITEN_EPS), torch.zeros_like(values))
    if convention == "openrlhf":
        mean, var = masked_moments(values, mask, reduce, ddof=0)
        scale = torch.rsqrt(var.clamp(min=WHITEN_EPS))
    else:
        mean, var = masked_moments(values, mask, reduce)
        scale = torch.rsqrt(var + WHITEN_EPS)
    return torch.where(mask.bool(), (values - mean) * scale, torch.zeros_like(values))


def torch_distributed_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over the default torch.distributed group (identity when not initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


# -- critic (PPO / VAPO, items 38-39) --------------------------------------------------------------------------------


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip: float | None = None, coef: float = 0.5) -> torch.Tensor:
    """``coef * mean_t max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)`` over valid tokens (default
    ``coef`` 0.5: verl/OpenRLHF's factor 1/2; token mean of this batch). ``clip=None``: the plain
    ``coef * (V - R)^2``. Tokens off the mask are left out with ``where``, inputs included: a non-finite value at a
    padded token would otherwise turn the gradient NaN (``where``'s backward multiplies it by 0)."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values, old_values, returns = (torch.where(valid, x, zero) for x in (values, old_values, returns))
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return coef * loss.sum() / valid.sum().clamp(min=1).to(loss.dtype)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       reduce: Reduce = None) -> torch.Tensor:
    """``1 - Var(R - V) / Var(R)`` over the valid tokens of the global batch (1: perfect, 0: no better than the mean,
    NaN when the returns do not vary)."""
    _, residual = masked_moments(returns - values, mask, reduce)
    _, total = masked_moments(returns, mask, reduce)
    return torch.where(total > 0, 1 - residual / total.clamp(min=1e-30), torch.full_like(total, float("nan")))
