"""Generation, scoring and on-disk caching shared by the data-building preference plugins.

Used by ``delta_pairs`` (chosen from a strong model, rejected from a weak one), ``iterative_dpo`` (K samples of the
current policy, best vs worst) and ``qrpo`` (n reference completions and their rewards).

* Model references resolve like the runner's ``model:`` field (``stage:<name>``, ``embedded:<name>``, a path or hub
  id) through :func:`trl_ext.runner.current_run`; outside a recipe run only plain paths are accepted.
* Completions are decoded up to and including the first eos token (pad tokens dropped), so a finished completion ends
  with the eos text exactly as the embedded preference data does; a completion cut by ``max_new_tokens`` has no eos
  (TRL's DPO trainer appends one). Callers that only *score* the samples (``pass_rate_filter``, ``pivot_rl``) pass
  ``skip_special_tokens=True`` to get the text TRL's GRPO/RLOO trainers hand reward functions instead.
* Caches are datasets saved under ``<cache root>/<key>`` where the key hashes everything the rows depend on; the main
  process builds and saves (atomically: temp folder + rename), the other processes wait and load
  (``PartialState().main_process_first()``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from trl_ext.recipe import EMBEDDED_PREFIX, STAGE_PREFIX

logger = logging.getLogger("trl_ext.preference")


def resolve_model(ref: str, plugin: str) -> str:
    """A model reference -> a loadable path/id. ``stage:``/``embedded:`` need a recipe run in progress."""
    from trl_ext.runner import current_run, resolve_model_ref

    run = current_run()
    if run is None:
        if ref.startswith((STAGE_PREFIX, EMBEDDED_PREFIX)):
            raise ValueError(f"{plugin}: model {ref!r} can only be resolved inside a recipe run (trl-ext train)")
        return ref
    return resolve_model_ref(ref, run)


def cache_root(explicit: str | None, plugin: str) -> Path:
    """``explicit`` if given, else ``<run output_dir>/_cache/<plugin>``."""
    from trl_ext.runner import current_run

    if explicit is not None:
        return Path(explicit)
    run = current_run()
    if run is None:
        raise ValueError(f"{plugin}: set `cache_dir` (no recipe run in progress to cache next to)")
    return run.output_dir / "_cache" / plugin


def model_fingerprint(path: str) -> dict[str, Any]:
    """Identity of a model for cache keys: a local folder's file names, sizes and modification times, or the hub id.

    Sizes and mtimes rather than content hashes, so keying a multi-GB model costs nothing; a retrained stage writes
    new files and so gets a new key.
    """
    folder = Path(path)
    if not folder.is_dir():
        return {"id": path}
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    return {"path": str(folder.resolve()),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def cache_key(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]


def on_main_process(build: Callable[[], Any], who: str, every_rank_runs: bool = False) -> Any:
    """``build()`` run on the main process only; its (picklable) result returned on every process.

    For data a plugin samples or scores (generations, verifier or judge verdicts): the hook contract asks every rank to
    end with the same rows, and sampling, timeouts or a remote judge need not agree across ranks when each rank builds
    its own copy (and each would pay for it). ``every_rank_runs``: every rank runs ``build`` (a model sharded by
    ZeRO-3 or FSDP generates only when every rank takes part) and the main process's result is kept. An exception on
    the main process is raised there and, naming ``who``, on the other processes, which would otherwise wait for the
    broadcast.
    """
    from accelerate import PartialState

    state = PartialState()
    if state.num_processes == 1:
        return build()
    from accelerate.utils import broadcast_object_list

    box: list[Any] = [None]
    failure = None
    if not state.is_main_process and every_rank_runs:
        try:
            build()
        except Exception:  # noqa: BLE001 - discarded: the main process's result (or error) decides
            pass
    if state.is_main_process:
        try:
            box = [("ok", build())]
        except Exception as exc:  # re-raised below, after the other processes have heard of it
            failure, box = exc, [("error", f"{type(exc).__name__}: {exc}")]
    broadcast_object_list(box, from_process=0)
    if failure is not None:
        raise failure
    kind, value = box[0]
    if kind == "error":
        raise RuntimeError(f"{who}: the main process failed building the data: {value}")
    return value


def cached_dataset(root: Path, key: str, build: Callable[[], Any]):
    """Load ``root/key`` if present, else build on the main process, save atomically, and load everywhere.

    Returns ``(dataset, hit)``; ``hit`` says whether this process found the cache already written before it ran.
    """
    import datasets
    from accelerate import PartialState

    target = root / key
    with PartialState().main_process_first():
        if (target / "dataset_info.json").exists() or (target / "state.json").exists():
            return datasets.load_from_disk(str(target)), True
        dataset = build()
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        try:
            dataset.save_to_disk(str(staging))
            os.replace(staging, target)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not target.exists():
                raise
        return datasets.load_from_disk(str(target)), False


def load_policy(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(path), tokenizer


def prompt_text(tokenizer, prompt) -> str:
    if isinstance(prompt, list):  # conversational: render as TRL renders prompts for generation
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return prompt


def as_completion(prompt, text: str):
    """A completion in the prompt's format: a string, or one assistant message for conversational prompts."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def completion_text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


@torch.no_grad()
def sample_completions(model, tokenizer, prompts: list, *, num_samples: int = 1, max_new_tokens: int = 8,
                       do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, batch_size: int = 64,
                       seed: int = 0, skip_special_tokens: bool = False) -> list[list[str]]:
    """``num_samples`` completions (text) per prompt. Greedy when ``do_sample`` is false (then one distinct answer).

    Sampling draws from the full distribution except for ``top_p`` (``top_k=0``, as TRL's samplers do), seeded with
    ``seed`` in a forked RNG so the caller's random state is untouched. The model's own ``generation_config`` is set
    aside for the call (:func:`own_distribution`): transformers fills every field a call leaves unset from it, so a
    model that ships, say, ``repetition_penalty: 1.05`` or a ``min_p`` would otherwise not be sampled from its own
    distribution (QRPO's reference samples must be draws of pi_ref).

    Each completion is cut after its first eos. By default special tokens stay in the text (a finished completion
    ends with the eos text, as training data for SFT/DPO needs). ``skip_special_tokens=True`` decodes as TRL's
    GRPO/RLOO trainers decode completions for their reward functions (``batch_decode(..., skip_special_tokens=True)``
    of the ids up to the eos): use it when the text is only scored, so a sample earns the reward it would earn in
    training (with the eos text kept, e.g. ``add(12,3)<|im_end|>``, a reward that parses the text can score it 0).
    """
    texts = [prompt_text(tokenizer, p) for p in prompts]
    sampling = ({"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} if do_sample
                else {"do_sample": False})
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    device = getattr(model, "device", torch.device("cpu"))
    was_training = model.training
    model.eval()
    out: list[list[str]] = []
    try:
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]), own_distribution(model):
            torch.manual_seed(seed)
            for start in range(0, len(texts), batch_size):
                batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                                  padding_side="left", add_special_tokens=False).to(device)
                generated = model.generate(**batch, max_new_tokens=max_new_tokens, num_return_sequences=num_samples,
                                           pad_token_id=pad, eos_token_id=eos, **sampling)
                new = generated[:, batch["input_ids"].shape[1]:].tolist()
                decoded = [tokenizer.decode(_until_eos(ids, eos, pad), skip_special_tokens=skip_special_tokens)
                           for ids in new]
                out += [decoded[i:i + num_samples] for i in range(0, len(decoded), num_samples)]
    finally:
        model.train(was_training)
    return out


@contextlib.contextmanager
def own_distribution(model):
    """Within the block, ``model`` (and the model a PEFT wrapper generates with) has a plain ``GenerationConfig``
    holding only its special token ids and cache setting, so ``generate`` applies no sampling field the caller did not
    pass (repetition penalties, min_p, typical_p, n-gram bans, forced or suppressed tokens, minimum lengths)."""
    from transformers import GenerationConfig

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    holders = [m for m in ((model,) if base is model else (model, base))
               if getattr(m, "generation_config", None) is not None]
    saved = [m.generation_config for m in holders]
    for m, config in zip(holders, saved):
        m.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
            decoder_start_token_id=config.decoder_start_token_id, cache_implementation=config.cache_implementation)
    try:
        yield
    finally:
        for m, config in zip(holders, saved):
            m.generation_config = config


def _until_eos(ids: list[int], eos: int, pad: int | None) -> list[int]:
    if eos in ids:
        ids = ids[:ids.index(eos) + 1]
    return [t for t in ids if t != pad or t == eos]


# ---------------------------------------------------------------------------------------------------------------------
# Scoring: a reward plugin by name, or a sequence-classification reward model


def reward_function_from_plugin(name: str, params: dict[str, Any] | None = None) -> Callable[..., list[float]]:
    """The weighted sum of the reward functions a reward plugin contributes, as ``fn(prompts, completions, **cols)``."""
    from trl_ext.catalog import Catalog
    from trl_ext.host import PluginHost
    from trl_ext.recipe import StageSpec
    from trl_ext.rewards import collect_reward_functions, weighted_reward
    from trl_ext.runner import current_run

    run = current_run()
    catalog = run.catalog if run is not None else Catalog.discover()
    info = catalog.resolve(name)
    plugin = info.cls(info.cls.Params.model_validate(params or {}))
    if "trl_ext_reward_functions" not in plugin.implemented_hooks():
        raise ValueError(f"plugin {name!r} is not a reward plugin (it contributes no reward functions)")
    probe = StageSpec(trainer="grpo", model="-", dataset={"source": "-"})
    functions = collect_reward_functions(PluginHost([plugin]), probe)
    return weighted_reward(functions)


def reward_model_scorer(path: str, batch_size: int = 32) -> Callable[..., list[float]]:
    """Score ``prompt + completion`` with a one-logit sequence-classification reward model (TRL RewardTrainer's)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()

    @torch.no_grad()
    def score(prompts, completions, **_columns):
        texts = [prompt_text(tokenizer, p) + completion_text(c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                              add_special_tokens=False).to(model.device)
            scores += model(**batch).logits[:, 0].float().tolist()
        return scores

    return score


def scorer(reward: str, reward_params: dict[str, Any] | None, reward_model: str | None, plugin: str):
    """A reward plugin (by catalog name) unless ``reward_model`` (a path/ref) is given."""
    if reward_model is not None:
        return reward_model_scorer(resolve_model(reward_model, plugin))
    return reward_function_from_plugin(reward, reward_params)
