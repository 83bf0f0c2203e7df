"""The learned value model of ``ppo``/``vapo``: a transformer trunk plus a scalar head, its optimizer, and the callback
that keeps both in the trainer's checkpoints."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn
from transformers import TrainerCallback

CRITIC_FILE = "critic.pt"


class ValueModel(nn.Module):
    """``V(s_t)`` for every completion token: a transformer trunk (no LM head) and a linear head ``hidden -> 1``.

    The value of completion token ``t`` is read at the position that *predicts* it (``P - 1 + t``), i.e. the state
    before the token is emitted, as in the RLHF PPO implementations (TRL's old PPOTrainer, OpenRLHF, verl).
    """

    def __init__(self, trunk: nn.Module, hidden_size: int, seed: int = 0, head: nn.Linear | None = None):
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(hidden_size, 1)
        with torch.no_grad():  # own generator: building the critic must not move the global RNG
            if head is not None:
                self.head.weight.copy_(head.weight.reshape(1, -1)[:1])
                self.head.bias.copy_(head.bias[:1] if head.bias is not None else torch.zeros(1))
            else:
                generator = torch.Generator().manual_seed(seed)
                self.head.weight.copy_(torch.randn(1, hidden_size, generator=generator) / (hidden_size + 1) ** 0.5)
                self.head.bias.zero_()

    def forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask,
                next_state: bool = False) -> torch.Tensor:
        """``(B, T)`` values; ``next_state``: ``(B, T + 1)``, column ``t`` of a row with ``t`` completion tokens being
        the state after its last token (read at that token's position), which a truncated row bootstraps from."""
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        start = prompt_ids.size(1) - 1
        states = hidden[:, start : start + completion_ids.size(1) + int(next_state)]
        return self.head(states.to(self.head.weight.dtype)).squeeze(-1)


def _trunk_of(model: nn.Module) -> nn.Module:
    return getattr(model, model.base_model_prefix)


def critic_from_policy(policy: nn.Module, seed: int = 0) -> ValueModel:
    """A value model on a copy of the policy's trunk (same initial weights; trained separately).

    Under DeepSpeed ZeRO-3 each rank holds only shards of the policy's parameters: they are gathered (as TRL gathers
    them for generation) into a trunk built by the class's own constructor, outside ZeRO-3's partitioned
    initialisation, so the critic is an ordinary module, replicated on every rank like under DDP (its gradients are
    averaged by the plugin)."""
    trunk = _trunk_of(policy)
    sharded = [p for p in trunk.parameters() if hasattr(p, "ds_id")]  # DeepSpeed's mark on a ZeRO-3 parameter
    if sharded:
        import deepspeed

        with deepspeed.zero.GatheredParameters(sharded, modifier_rank=None):
            state = {name: tensor.detach().clone() for name, tensor in trunk.state_dict().items()}
        copied = type(trunk)(trunk.config)
        copied.load_state_dict(state)
    else:
        copied = copy.deepcopy(trunk)
    copied.requires_grad_(True)
    return ValueModel(copied, policy.config.hidden_size, seed)


def critic_from_path(path: str, seed: int = 0) -> ValueModel:
    """A value model loaded from a Hugging Face folder. A sequence-classification checkpoint (a reward model) gives
    the trunk *and* the head (its score head); any other model gives the trunk and a fresh head."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(path)
    if any(a.endswith("ForSequenceClassification") for a in (config.architectures or [])):
        reward_model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
        return ValueModel(_trunk_of(reward_model), config.hidden_size, seed, head=reward_model.score)
    return ValueModel(AutoModel.from_pretrained(path), config.hidden_size, seed)


class CriticCheckpointCallback(TrainerCallback):
    """Saves the critic and its optimizer into every checkpoint folder and restores them when training resumes."""

    def __init__(self, owner):
        self.owner = owner  # the ppo plugin: holds .critic, .critic_optimizer, .trainer

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(self.owner.critic_state(), folder / CRITIC_FILE)

    def on_train_begin(self, args, state, control, **kwargs):
        self.restore_from_checkpoint(args, state)

    def restore_from_checkpoint(self, args, state) -> None:  # also called for a stage finished from its last step
        if state.global_step == 0:
            return
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", CRITIC_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"plugin 'ppo': resuming at step {state.global_step} but {path} is missing; the "
                                    "critic cannot be restored")
        self.owner.load_critic_state(torch.load(path, map_location="cpu", weights_only=True))
