"""``ppo``: PPO for RLHF with a learned critic and GAE on the GRPO trainer."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from trl_ext import Need, Plugin, Slot, hookimpl
from trl_ext.ops import ends_with
from trl_ext_plugins.advantages.critic import CriticCheckpointCallback, critic_from_path, critic_from_policy
from trl_ext_plugins.advantages.math import (
    Whitening,
    clipped_value_loss,
    explained_variance,
    gae,
    length_adaptive_lambda,
    masked_moments,
    masked_whiten,
    token_rewards,
)
from trl_ext_plugins.advantages.rollout import (
    RewardKLHooks,
    RewardKLParams,
    kept_loss_mask,
    local,
    rank_reduce,
    reward_kl,
)


def rank_token_share(mask: torch.Tensor, trainer) -> torch.Tensor | float:
    """``world_size * local tokens / global tokens``: the factor that turns a rank's token-mean loss into its share of
    the global token mean when the ranks' losses (or gradients) are then averaged. 1 on one process."""
    world = trainer.accelerator.num_processes
    if world == 1:
        return 1.0
    local = mask.sum().to(torch.float32)
    total = trainer.accelerator.reduce(local.clone(), reduction="sum")
    return torch.where(total > 0, world * local / total.clamp(min=1), torch.zeros_like(local))


def end_tokens(trainer) -> list[int]:
    """The tokens that end a completion for TRL's ``mask_truncated_completions``: EOS ids and the pad id."""
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    ids = list(getattr(trainer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    return ids + ([tokenizer.pad_token_id] if tokenizer.pad_token_id is not None else [])


def truncated_row_bootstrap(values_next: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                            ended_by: list[int]) -> torch.Tensor:
    """``(B,)`` values to bootstrap GAE from: for a non-empty row whose last completion token is not in
    ``ended_by`` (cut off by the length budget), its ``(B, T + 1)`` ``values_next`` at column ``t`` (the state after
    its ``t`` tokens); 0 for a row that ended or is empty."""
    count = completion_mask.sum(-1).long()
    after_last = values_next.gather(1, count.unsqueeze(-1)).squeeze(-1)
    truncated = (count > 0) & ~ends_with(completion_ids, completion_mask, ended_by)
    return torch.where(truncated, after_last, torch.zeros_like(after_last))


class PPOParams(RewardKLParams):
    critic: Literal["policy_copy", "path"] = Field(
        "policy_copy", description="policy_copy: a value head on a copy of the policy's trunk; path: a value model "
        "loaded from critic_path (a sequence-classification reward model gives trunk and head).")
    critic_path: str | None = Field(None, description="Hugging Face folder of the critic when critic: path.")
    critic_lr: float = Field(1e-5, gt=0.0, description="AdamW learning rate of the critic (verl critic default).")
    critic_epochs: int = Field(1, ge=1, description="Passes of critic updates over each rollout batch.")
    critic_mini_batches: int = Field(1, ge=1, description="Critic optimizer steps per pass (the rank's rollout batch "
                                     "split into this many mini-batches, shuffled with a per-step seeded generator).")
    critic_max_grad_norm: float | None = Field(1.0, gt=0.0, description="Gradient-norm clip of the critic (None: off).")
    critic_warmup_steps: int = Field(0, ge=0, description="Optimizer steps (trainer.state.global_step) during which "
                                     "only the critic learns: the policy's advantages are 0, so it gets no gradient.")
    value_clip: float | None = Field(0.5, gt=0.0, description="epsilon_v of the clipped value loss "
                                     "max((V-R)^2, (clip(V, V_old +- eps_v) - R)^2) (OpenRLHF/verl 0.5; None: off).")
    value_loss_coef: float = Field(0.5, gt=0.0, description="c_v in the critic loss c_v * mean_t max((V-R)^2, ...): "
                                   "0.5 (verl, OpenRLHF); TRL's PPOTrainer optimises 0.5 * vf_coef (0.1) = 0.05 of it "
                                   "together with the policy. The critic has its own AdamW, so c_v changes its update "
                                   "only through the gradient-norm clip and Adam's epsilon.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount of GAE (RLHF: 1).")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda of the policy's advantages.")
    lam_critic: float | None = Field(None, ge=0.0, le=1.0, description="GAE lambda of the critic's targets "
                                     "R = A + V (None: the same as lam; VAPO decouples with 1.0).")
    length_adaptive_alpha: float | None = Field(None, gt=0.0, description="If set, the policy lambda of each sequence "
                                                "is 1 - 1/(alpha * l) (VAPO, alpha 0.05), replacing lam.")
    kl_coef: float = Field(0.01, ge=0.0, description="beta of the k1 KL to the reference folded into the token rewards "
                           "r_t = 1[t = last] * R - beta * KL_t (OpenRLHF init_kl_coef 0.01; 0: no reference).")
    kl_in_loss: bool = Field(True, description="With a non-zero args.beta: true (default, as before) keeps TRL's "
                             "args.beta k3 KL term in the loss too; false drops it (the KL only in the reward). With "
                             "args.beta 0 (TRL's default) there is no loss term either way: the plugin sets args.beta "
                             "1.0 only so TRL computes the reference log-probs.")
    truncation: Literal["terminal", "bootstrap"] = Field(
        "terminal", description="How GAE ends a truncated completion (its last token neither EOS nor padding, as TRL's "
        "mask_truncated_completions decides): terminal (default; TRL's old PPOTrainer, verl, OpenRLHF): V after the "
        "last token is 0, as at a real end; bootstrap (AReaL, the time-limit rule of Pardo et al. 2018, arXiv "
        "1712.00378): the critic's value of the state after the last token, read at that token's position, so the "
        "critic is not taught that a cut-off answer is worth only its reward.")
    whiten_advantages: bool = Field(True, description="Whiten the advantages over the valid tokens of the global "
                                    "batch (verl/OpenRLHF GAE default).")
    whitening: Whitening = Field("verl", description="How whiten_advantages whitens: verl (default; unbiased "
                                 "variance, (x - mean) / sqrt(var + 1e-8)), openrlhf (population variance, (x - mean) "
                                 "/ sqrt(max(var, 1e-8))), areal ((x - mean) / (unbiased std + 1e-5)) or none (the "
                                 "same as whiten_advantages: false).")

    @model_validator(mode="after")
    def _path_given(self):
        if self.critic == "path" and not self.critic_path:
            raise ValueError("critic: path needs critic_path")
        return self


class PPO(RewardKLHooks, Plugin):
    """PPO for RLHF (Schulman et al. 2017, arXiv 1707.06347; Ziegler et al. 2019, arXiv 1909.08593; InstructGPT,
    arXiv 2203.02155) with a learned value model and GAE (arXiv 1506.02438), on the GRPO trainer.

    Each rollout: the critic scores prompt + completion (no grad) giving ``V(s_t)`` per completion token; token rewards
    ``r_t = 1[t = T] * R - kl_coef * KL_t`` (k1 on ``log pi_old - log pi_ref`` by default, k2/k3 selectable,
    optionally clamped to ``+-kl_clamp``; KL folded into the reward);
    GAE ``A_t = sum_l (gamma lam)^l delta_{t+l}``, ``delta_t = r_t + gamma V_{t+1} - V_t``, ``V`` after the last token
    0; the policy gets the ``(B, T)`` advantages (whitened over the global batch by default, verl's unbiased variance
    and ``sqrt(var + 1e-8)``; ``whitening: openrlhf`` for OpenRLHF's population variance and ``sqrt(max(var,
    1e-8))``) and the GRPO trainer's
    clipped objective (``args.epsilon``, ``loss_type``). The critic, a separate module with its own AdamW optimizer,
    is then trained on the same rollout *before* the policy steps (verl's order) on targets ``R_t = A_t + V_t`` (with
    ``lam_critic``), loss ``c_v * mean_t max((V - R)^2, (clip(V, V_old +- eps_v) - R)^2)``; with several ranks its
    gradients are averaged across them. During ``critic_warmup_steps`` only the critic learns (advantages are 0; with
    AdamW and weight decay 0 the policy does not move).

    Defaults: gamma 1, lam 0.95, value_clip 0.5 (OpenRLHF/verl; null: unclipped), value_loss_coef c_v 0.5 (verl,
    OpenRLHF; TRL PPOTrainer's shared loss uses 0.5 * vf_coef 0.1), kl_coef 0.01 k1 (OpenRLHF), critic_lr 1e-5 (verl;
    the critic's own optimizer, independent of the policy's learning_rate),
    one critic step per rollout, critic = value head on a copy of the policy trunk (head ~ N(0, 1/(H+1)), seeded).
    Conventions: the value of token ``t`` is read at the position predicting it; unscorable rows count as reward 0;
    a truncated completion ends GAE as a terminal state (``truncation: terminal``, verl/OpenRLHF/TRL) or bootstraps
    from the critic's value after its last token (``truncation: bootstrap``, AReaL);
    the reference log-probs are computed whenever ``kl_coef > 0`` (:class:`RewardKLHooks`): a recipe's non-zero
    ``args.beta`` also adds TRL's k3 KL *loss* term unless ``kl_in_loss: false`` (InstructGPT's form, the KL in the
    reward only); with ``args.beta`` 0 there is no loss term and the plugin sets ``args.beta: 1.0`` only so TRL
    computes the reference. ``kl_coef: 0`` runs without a reference.
    On several processes the critic is replicated on every rank (built from gathered shards under ZeRO-3); each
    rank's value loss is weighted by its share of the global tokens before the gradients are averaged, so the critic
    step is the one a single process takes on the same global batch (tested under DDP, FSDP2, ZeRO-2 and ZeRO-3).
    The critic and its optimizer are saved as ``critic.pt`` in each checkpoint folder and restored on resume; the
    final critic is saved to ``<stage output>/critic.pt``. Logged: ``ppo/value_loss``, ``ppo/explained_variance``
    (critic before this rollout's update vs the targets), ``ppo/returns_mean``, ``ppo/advantages_mean``,
    ``ppo/values_mean``, ``ppo/kl``.
    """

    name = "ppo"
    family = "advantage"
    trainers = frozenset({"grpo"})
    slots = frozenset({Slot.ADVANTAGE})
    provides = frozenset({Need.VALUE_MODEL})
    Params = PPOParams

    def __init__(self, params=None):
        super().__init__(params)
        # instance-level needs: the reference is required only when the KL is folded into the reward
        self.needs = self._reward_kl_needs()
        self.critic = None
        self.critic_optimizer = None
        self.trainer = None

    # -- construction and checkpoints -------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return self._reward_kl_args(args)

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        self.trainer = trainer
        self._reward_kl_trainer_created(trainer)
        seed = trainer.args.seed
        if self.params.critic == "path":
            critic = critic_from_path(self.params.critic_path, seed)
        else:
            critic = critic_from_policy(trainer.accelerator.unwrap_model(trainer.model), seed)
        self.critic = critic.to(device=trainer.accelerator.device, dtype=torch.float32)
        self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=self.params.critic_lr, weight_decay=0.0)
        trainer.add_callback(CriticCheckpointCallback(self))

    def critic_state(self) -> dict:
        return {"model": self.critic.state_dict(), "optimizer": self.critic_optimizer.state_dict()}

    def load_critic_state(self, state: dict) -> None:
        self.critic.load_state_dict(state["model"])
        self.critic_optimizer.load_state_dict(state["optimizer"])

    @hookimpl
    def trl_ext_after_stage(self, stage, output_dir, trainer):
        if self.critic is not None and trainer.accelerator.is_main_process:
            torch.save(self.critic_state(), f"{output_dir}/critic.pt")
        return None

    # -- advantages and the critic update ---------------------------------------------------------------------------

    def in_critic_warmup(self, trainer) -> bool:
        """Whether this rollout falls in the first ``critic_warmup_steps`` optimizer steps (only the critic learns)."""
        return trainer is not None and trainer.state.global_step < self.params.critic_warmup_steps

    def policy_lambda(self, mask: torch.Tensor) -> float | torch.Tensor:
        if self.params.length_adaptive_alpha is None:
            return self.params.lam
        return length_adaptive_lambda(mask.sum(-1), self.params.length_adaptive_alpha)

    def token_level_rewards(self, rewards: torch.Tensor, batch, mask: torch.Tensor) -> torch.Tensor:
        sequence = torch.nan_to_num(local(rewards, batch)).to(torch.float32)
        if self.params.kl_coef <= 0:
            return token_rewards(sequence, mask)
        kl = reward_kl(batch, self.params.kl_estimator, self.params.kl_clamp, "ppo/kl")
        return token_rewards(sequence, mask, kl, self.params.kl_coef)

    @hookimpl
    def trl_ext_compute_advantages(self, rewards, batch):
        p = self.params
        trainer = batch.trainer
        # completion tokens minus tool tokens, as the policy loss, of the rows the filters kept: the whitening, the
        # logged figures and the critic's update see no dropped group (verl removes them before all three); a group
        # partial_rollout defers was scored on unfinished text, no target for the critic
        mask = kept_loss_mask(batch)
        critic_inputs = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
        self.critic.eval()
        bootstrapping = p.truncation == "bootstrap"
        bootstrap = None
        with torch.no_grad():
            if bootstrapping:  # one more column: the state after each row's last token
                values_next = self.critic(*critic_inputs, next_state=True).float()
                bootstrap = truncated_row_bootstrap(values_next, batch.completion_ids, batch.completion_mask,
                                                    end_tokens(trainer))
                old_values = values_next[:, :-1]
            else:
                old_values = self.critic(*critic_inputs).float()
            old_values = torch.where(mask.bool(), old_values, torch.zeros_like(old_values))
        per_token = self.token_level_rewards(rewards, batch, mask)
        advantages, _ = gae(per_token, old_values, mask, p.gamma, self.policy_lambda(mask), bootstrap)
        lam_critic = p.lam if p.lam_critic is None else p.lam_critic
        _, returns = gae(per_token, old_values, mask, p.gamma, lam_critic, bootstrap)

        reduce = rank_reduce(batch)
        batch.metrics["ppo/explained_variance"] = explained_variance(old_values, returns, mask, reduce).item()
        batch.metrics["ppo/returns_mean"] = masked_moments(returns, mask, reduce)[0].item()
        batch.metrics["ppo/values_mean"] = masked_moments(old_values, mask, reduce)[0].item()
        batch.metrics["ppo/advantages_mean"] = masked_moments(advantages, mask, reduce)[0].item()
        if trainer is not None and trainer.model.training:
            batch.metrics["ppo/value_loss"] = self.update_critic(critic_inputs, old_values, returns, mask, batch)
        if p.whiten_advantages:
            advantages = masked_whiten(advantages, mask, reduce, p.whitening)
        if self.in_critic_warmup(trainer):
            batch.metrics["ppo/critic_warmup"] = 1.0
            advantages = torch.zeros_like(advantages)
        return advantages.detach()

    def update_critic(self, critic_inputs, old_values, returns, mask, batch) -> float:
        """Train the critic on this rank's rollout; returns the mean clipped value loss over its steps."""
        p, trainer = self.params, batch.trainer
        rows = mask.shape[0]
        generator = torch.Generator().manual_seed(int(trainer.args.seed) * 1_000_003 + int(trainer.state.global_step))
        self.critic.train()
        losses = []
        for _ in range(p.critic_epochs):
            order = torch.randperm(rows, generator=generator).to(mask.device)
            for chunk in order.chunk(p.critic_mini_batches):
                values = self.critic(*(t[chunk] for t in critic_inputs)).float()
                loss = clipped_value_loss(values, old_values[chunk], returns[chunk], mask[chunk], p.value_clip,
                                          p.value_loss_coef)
                # The rank's token mean, weighted so that the mean over ranks (the gradient reduction below) is the
                # token mean over every rank's tokens, as one process computes it on the same global batch.
                loss = loss * rank_token_share(mask[chunk], trainer)
                self.critic_optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self._sync_gradients(trainer)
                if p.critic_max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(self.critic.parameters(), p.critic_max_grad_norm)
                self.critic_optimizer.step()
                losses.append(loss.detach())
        self.critic_optimizer.zero_grad(set_to_none=True)
        self.critic.eval()
        mean = torch.stack(losses).mean()
        if trainer.accelerator.num_processes > 1:
            mean = trainer.accelerator.reduce(mean, reduction="mean")
        return mean.item()

    def _sync_gradients(self, trainer) -> None:
        """Mean of the ranks' gradients (each rank's loss carries its :func:`rank_token_share`)."""
        if trainer.accelerator.num_processes == 1:
            return
        for param in self.critic.parameters():
            if param.grad is not None:
                param.grad = trainer.accelerator.reduce(param.grad, reduction="mean")
