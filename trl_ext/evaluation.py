"""Held-out evaluation by generation: decode each prompt and score the completions with a reward function."""

import contextlib
from collections.abc import Callable

import torch

NUM_SHOWN_SAMPLES = 5


@contextlib.contextmanager
def evaluation_model(trainer, is_main_process: bool):
    """``(model, evaluate_here)`` for a held-out evaluation of the trainer's model; enter it on **every** rank.

    Without sharding the main process evaluates alone on the unwrapped model. Under DeepSpeed ZeRO-3 or FSDP each
    rank holds a shard of every weight and a forward pass is a collective, so the main process cannot generate alone
    (ZeRO-3: ``'weight' must be 2-D`` before the engine exists, a hang in the engine's fetch hooks after): every rank
    then runs the same evaluation in step (same prompts, greedy or seeded sampling; the main process's result is the
    one written), inside TRL's ``unwrap_model_for_generation``, which gathers ZeRO-3 weights as TRL's own generation
    does. The caller waits for every rank (a barrier) after the block.
    """
    from trl.distributed import DistributedBackend
    from trl.models import unwrap_model_for_generation

    if not (getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False)):
        # no engine (one process, DDP, a merge stage's stand-in accelerator): the model as it is, main process only
        yield trainer.accelerator.unwrap_model(trainer.model), is_main_process
        return
    backend = DistributedBackend(trainer.accelerator)
    sharded = backend.is_zero3 or backend.is_fsdp
    wrapped = getattr(trainer, "model_wrapped", None) or trainer.model
    with unwrap_model_for_generation(wrapped, trainer.accelerator) as model:
        yield model, sharded or is_main_process


@torch.no_grad()
def evaluate_generation(
    model,
    tokenizer,
    dataset,
    reward_fn: Callable[..., list[float]],
    max_new_tokens: int = 8,
    batch_size: int = 64,
    greedy: bool = True,
    temperature: float = 1.0,
    num_samples: int = 1,
    seed: int | None = None,
    reward_kwargs: dict | None = None,
) -> dict:
    """Generate completions for `dataset["prompt"]` and score them with `reward_fn`.

    `reward_fn` is called like a TRL reward function: `reward_fn(prompts=..., completions=..., completion_ids=...,
    **columns, **reward_kwargs)` with the dataset's other columns (e.g. `answer`; not `completion`, as in TRL)
    repeated once per sample,
    `completion_ids` each completion's generated token ids up to and including its EOS (TRL's convention), and
    `reward_kwargs` the other keywords TRL passes in training (the caller's `trainer_state`, `log_metric`, ...), so
    a function written for TRL's signature scores the held-out split as it scored training. Returns
    {"accuracy": share of completions earning the full reward 1.0, "reward_mean": mean reward,
    "n": number of completions scored, "samples": the first few prompts, completions and rewards}. Greedy decoding is deterministic and ignores `temperature`
    and `num_samples` (every sample would be the same); sampling draws `num_samples` per prompt.
    With `seed`, sampling draws from a forked RNG seeded with it, so the caller's random state is untouched.
    The model is put in eval mode for generation and given back in the mode it came in.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}")
    samples = 1 if greedy else num_samples
    columns = {name: dataset[name] for name in dataset.column_names}
    prompts = [_prompt_text(tokenizer, prompt) for prompt in columns.pop("prompt")]
    device = getattr(model, "device", torch.device("cpu"))
    # Sampling draws from the full distribution (top_k=0), as TRL's GRPO and RLOO do by default.
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_k": 0}

    seeded = contextlib.nullcontext() if greedy or seed is None else _seeded_rng(seed, device)
    was_training = model.training
    model.eval()
    try:
        completions, completion_ids = [], []
        with seeded:
            for start in range(0, len(prompts), batch_size):
                # Left padding puts every prompt's last token at the end, where generation continues.
                batch = tokenizer(
                    prompts[start : start + batch_size],
                    return_tensors="pt",
                    padding=True,
                    padding_side="left",
                    add_special_tokens=False,
                ).to(device)
                output = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    num_return_sequences=samples,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    **sampling,
                )
                new_tokens = output[:, batch["input_ids"].shape[1] :]
                completions += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
                completion_ids += [_until_eos(row, tokenizer.eos_token_id) for row in new_tokens.tolist()]
    finally:
        model.train(was_training)

    # generate() returns the samples of one prompt next to each other; repeat the columns to match.
    def repeat(values: list) -> list:
        return [value for value in values for _ in range(samples)]

    # As TRL's _calculate_rewards: the row's columns except the ones it passes itself, then its own keywords.
    keywords = {name: repeat(values) for name, values in columns.items() if name not in TRL_SUPPLIED_COLUMNS}
    keywords.update(reward_kwargs or {})
    rewards = reward_fn(prompts=repeat(prompts), completions=completions, completion_ids=completion_ids, **keywords)
    shown = repeat(prompts)[:NUM_SHOWN_SAMPLES]
    return {
        **reward_summary(rewards),
        # A few completions with their rewards, so eval.json shows what the numbers mean.
        "samples": [{"prompt": prompt, "completion": completion, "reward": reward}
                    for prompt, completion, reward in zip(shown, completions, rewards)],
    }


def sampled_evaluation(model, tokenizer, dataset, reward_fn: Callable[..., list[float]], k: int, temperature: float,
                       seed: int, max_new_tokens: int = 8, batch_size: int = 64,
                       reward_kwargs: dict | None = None) -> dict:
    """``k`` sampled completions per prompt at ``temperature``: their mean accuracy and reward (the sampled pass@1 of
    RL papers), as ``sampled_accuracy``, ``sampled_reward_mean``, ``sampled_n``. The draw comes from a forked RNG
    seeded with ``seed``, so adding the evaluation changes no training sample."""
    sampled = evaluate_generation(model, tokenizer, dataset, reward_fn, max_new_tokens=max_new_tokens,
                                  batch_size=batch_size, greedy=False, temperature=temperature, num_samples=k,
                                  seed=seed, reward_kwargs=reward_kwargs)
    return {"sampled_accuracy": sampled["accuracy"], "sampled_reward_mean": sampled["reward_mean"],
            "sampled_n": sampled["n"]}


def reward_summary(rewards: list) -> dict:
    """``accuracy`` (share of rewards >= 1) and ``reward_mean`` over the scored rows, ``n`` (all rows) and
    ``unscored``: rows the reward returned None (or NaN) for, e.g. a gold answer math_verify cannot parse. TRL leaves
    such rows out of training; here they crashed the evaluation (None >= 1.0) after the stage had trained."""
    scored = [float(r) for r in rewards if r is not None and r == r]
    count = len(scored)
    return {"accuracy": sum(r >= 1.0 for r in scored) / count if count else 0.0,
            "reward_mean": sum(scored) / count if count else 0.0,
            "n": len(rewards), "unscored": len(rewards) - count}


@contextlib.contextmanager
def _seeded_rng(seed: int, device: torch.device):
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(seed)
        yield


# Dataset columns TRL's reward call does not forward: it passes the prompts and completions it generated itself.
TRL_SUPPLIED_COLUMNS = ("prompt", "completion", "completion_ids")


def _until_eos(ids: list[int], eos_token_id: int | list[int] | None) -> list[int]:
    """A generated row cut after its first EOS (generate pads the rest of a finished row)."""
    eos = set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
    end = next((i + 1 for i, token in enumerate(ids) if token in eos), len(ids))
    return ids[:end]


def training_reward_kwargs(trainer) -> dict:
    """The keywords TRL's trainers give reward functions besides the batch (the trainer's state; logging callbacks,
    which log nothing at evaluation), for :func:`evaluate_generation`'s ``reward_kwargs``."""
    state = getattr(trainer, "state", None)
    return {"trainer_state": state, "log_extra": _ignore, "log_metric": _ignore}


def _ignore(*args, **kwargs) -> None:
    return None


def _prompt_text(tokenizer, prompt) -> str:
    # Conversational prompts are rendered the way TRL renders them for generation.
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return prompt
