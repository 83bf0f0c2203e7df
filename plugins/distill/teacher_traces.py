"""``teacher_traces``: sequence-level distillation, SFT on a teacher's generated responses."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext_plugins.distill import teachers as tch
from trl_ext_plugins.preference import generation as gen

logger = logging.getLogger("trl_ext.distill")


class TeacherTracesParams(PluginParams):
    teacher: str = Field(..., description="The teacher: a local folder or hub id, `embedded:<name>`, `stage:<name>` "
                                          "(an earlier stage), or with `endpoint` the model name the server serves.")
    endpoint: str | None = Field(None, description="Base URL of an OpenAI-compatible server (e.g. "
                                                   "http://127.0.0.1:8000/v1); completions come from its "
                                                   "/completions (text prompts) or /chat/completions (messages).")
    api_key_env: str | None = Field(None, description="Environment variable holding the endpoint's API key (sent "
                                                      "as a Bearer token); None: no key.")
    num_samples: int = Field(1, gt=0, description="Responses per prompt (each becomes one SFT row).")
    max_new_tokens: int = Field(64, gt=0, description="Generation length limit.")
    do_sample: bool = Field(False, description="Sample instead of greedy decoding (local teachers; endpoints get "
                                               "temperature 0 when false).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (with do_sample).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass (with do_sample).")
    seed: int = Field(0, description="Sampling seed.")
    batch_size: int = Field(64, gt=0, description="Prompts per generate() call or endpoint request.")
    chunk_size: int = Field(256, gt=0, description="Prompts per cached chunk: an interrupted generation resumes at "
                                                   "the first chunk not yet on disk.")
    reward: str | None = Field(None, description="Reward plugin (e.g. exact_match, math_verify) that must accept a "
                                                 "response for it to be kept; None keeps every response.")
    reward_params: dict[str, Any] = Field(default_factory=dict, description="Parameters of the reward plugin.")
    min_reward: float = Field(1.0, description="Keep responses whose reward is at least this (with `reward`).")
    cache_dir: str | None = Field(None, description="Cache root; default `<run output_dir>/_cache/teacher_traces`.")
    splits: list[str] = Field(["train"], description="Dataset splits replaced by teacher traces.")
    timeout_s: float = Field(120.0, gt=0, description="Endpoint request timeout in seconds.")

    @model_validator(mode="after")
    def _endpoint_scheme(self):
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"endpoint must be an http(s) URL, got {self.endpoint!r}")
        return self


class TeacherTraces(Plugin):
    """Sequence-level knowledge distillation (Kim & Rush 2016, arXiv 1606.07947; DeepSeek-R1 distillation, arXiv
    2501.12948): replace the stage's SFT targets by a teacher's responses, optionally keeping only those a reward
    plugin accepts (rejection sampling on the teacher, ALGORITHMS.md item 2).

    For each prompt of the split, ``num_samples`` responses come from the teacher (a local/hub/embedded/stage model
    with transformers generation, greedy by default; or an OpenAI-compatible ``endpoint``); rows become
    ``prompt``/``completion`` plus the dataset's other columns (e.g. ``answer``, used by the reward). Local-model
    completions end with the eos text (like the embedded SFT data); endpoint completions have none, and the SFT trainer
    appends eos. The raw generations are cached on disk as datasets, content-addressed by the teacher (folder file
    sizes and mtimes, or endpoint URL + model name), the prompts and the generation settings, in chunks of
    ``chunk_size`` prompts (only the completions are taken from the cache; the other columns come from the dataset as
    it is now, so a corrected label is scored): a rerun reuses them, an interrupted run resumes at the first missing chunk, and a changed
    teacher, prompt set or setting regenerates. The reward filter runs after the cache (changing it regenerates
    nothing); the kept fraction is logged, and nothing kept is an error. The loss is the stage's SFT loss unchanged
    (item 3: identical numerics to SFT).
    """

    name = "teacher_traces"
    family = "distill"
    trainers = frozenset({"sft"})
    Params = TeacherTracesParams

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        if self.params.endpoint is not None:
            return []
        problem = tch.teacher_ref_problem(self.params.teacher, "params.teacher")
        if problem:
            return [f"plugin 'teacher_traces': {problem}"]
        if tch.is_local_path(self.params.teacher) and tch.is_local_path(stage.model):
            try:
                tch.check_paths_share_tokenizer(stage.model, self.params.teacher)
            except tch.TeacherError as exc:
                return [f"plugin 'teacher_traces': {exc}"]
        return []

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        if split not in self.params.splits:
            return None
        if "prompt" not in dataset.column_names:
            raise ValueError(f"teacher_traces: the {split} dataset has no 'prompt' column "
                             f"(has: {', '.join(dataset.column_names)})")
        if len(dataset) == 0:
            raise ValueError(f"teacher_traces: the {split} dataset has no rows (no prompt to ask the teacher)")
        source = self._source()
        settings = self.params.model_dump(exclude={"teacher", "endpoint", "api_key_env", "reward", "reward_params",
                                                   "min_reward", "cache_dir", "splits", "batch_size", "timeout_s"})
        # list(): datasets' Column would hash by its truncated repr, so two prompt sets could share a key
        key = gen.cache_key({"teacher": source.identity(), "prompts": list(dataset["prompt"]), "settings": settings})
        root = gen.cache_root(self.params.cache_dir, self.name) / key
        traces = generate_in_chunks(dataset, source, root, self.params.chunk_size, self.params.num_samples)
        return self._filter(traces) if self.params.reward else traces

    def _source(self):
        p = self.params
        if p.endpoint is not None:
            key = os.environ.get(p.api_key_env) if p.api_key_env else None
            return EndpointTeacher(p.endpoint, p.teacher, key, p, p.timeout_s)
        return LocalTeacher(gen.resolve_model(p.teacher, self.name), p)

    def _filter(self, traces):
        score = gen.reward_function_from_plugin(self.params.reward, self.params.reward_params)
        columns = {c: traces[c] for c in traces.column_names if c not in ("prompt", "completion")}
        rewards = score(prompts=traces["prompt"], completions=traces["completion"], **columns)
        keep = [i for i, r in enumerate(rewards) if r is not None and r >= self.params.min_reward]
        logger.info("teacher_traces: kept %d of %d responses (reward %s >= %s)", len(keep), len(rewards),
                    self.params.reward, self.params.min_reward)
        if not keep:
            raise ValueError(f"teacher_traces: the reward {self.params.reward!r} accepted none of the {len(rewards)} "
                             "teacher responses")
        return traces.select(keep)


class LocalTeacher:
    """A model loaded with transformers (loaded on first use, once)."""

    def __init__(self, path: str, params: TeacherTracesParams):
        self.path, self.params, self._model = path, params, None

    def identity(self) -> dict[str, Any]:
        return gen.model_fingerprint(self.path)

    def generate(self, prompts: list) -> list[list[str]]:
        if self._model is None:
            self._model = gen.load_policy(self.path)
        model, tokenizer = self._model
        p = self.params
        return gen.sample_completions(model, tokenizer, prompts, num_samples=p.num_samples,
                                      max_new_tokens=p.max_new_tokens, do_sample=p.do_sample,
                                      temperature=p.temperature, top_p=p.top_p, batch_size=p.batch_size, seed=p.seed)


class EndpointTeacher:
    """An OpenAI-compatible server: ``POST {base}/completions`` for text prompts, ``/chat/completions`` for messages."""

    def __init__(self, base: str, model: str, api_key: str | None, params: TeacherTracesParams, timeout: float):
        self.base, self.model, self.api_key, self.params, self.timeout = base.rstrip("/"), model, api_key, params, timeout

    def identity(self) -> dict[str, Any]:
        return {"endpoint": self.base, "model": self.model}

    def _post(self, route: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            return tch.http_json(f"{self.base}/{route}", payload, self.timeout, self.api_key)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"teacher_traces: endpoint {self.base}/{route} failed: {exc}") from None

    def _sampling(self) -> dict[str, Any]:
        p = self.params
        sampling = {"temperature": p.temperature, "top_p": p.top_p} if p.do_sample else {"temperature": 0.0}
        return {"model": self.model, "max_tokens": p.max_new_tokens, "n": p.num_samples, "seed": p.seed, **sampling}

    def generate(self, prompts: list) -> list[list[str]]:
        n = self.params.num_samples
        if prompts and isinstance(prompts[0], list):  # conversational: one chat request per prompt
            out = []
            for messages in prompts:
                reply = self._post("chat/completions", {**self._sampling(), "messages": messages})
                out.append([c["message"]["content"] for c in sorted(reply["choices"], key=lambda c: c["index"])])
            return out
        out = []
        for start in range(0, len(prompts), self.params.batch_size):
            batch = prompts[start:start + self.params.batch_size]
            reply = self._post("completions", {**self._sampling(), "prompt": batch})
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            if len(choices) != len(batch) * n:
                raise RuntimeError(f"teacher_traces: endpoint returned {len(choices)} choices for {len(batch)} "
                                   f"prompts x {n} samples")
            out += [[c["text"] for c in choices[i * n:(i + 1) * n]] for i in range(len(batch))]
        return out


def generate_in_chunks(dataset, source, root: Path, chunk_size: int, num_samples: int):
    """Teacher traces for every row, chunk by chunk; chunks already on disk are reused (resume)."""
    import datasets
    from accelerate import PartialState

    with PartialState().main_process_first():
        parts = []
        for index, start in enumerate(range(0, len(dataset), chunk_size)):
            target = root / f"chunk-{index:05d}"
            if not (target / "dataset_info.json").exists():
                rows = dataset.select(range(start, min(start + chunk_size, len(dataset))))
                responses = source.generate(list(rows["prompt"]))
                _save_atomic(traces_dataset(rows, responses, num_samples), target)
            parts.append(datasets.load_from_disk(str(target)))
        cached = datasets.concatenate_datasets(parts)
    return with_current_columns(dataset, cached["completion"], num_samples)


def with_current_columns(dataset, completions: list, num_samples: int):
    """The traces as rows of the *current* dataset: only the completions come from the cache.

    The cache is keyed by the teacher, the prompts and the generation settings, not by the other columns, so a
    corrected ``answer`` (or an added column) must come from the dataset as it is now, or the reward filter would
    score against the label the cache was written with. Cached completions are in prompt order, ``num_samples`` per
    prompt (the key holds the prompts in order)."""
    from datasets import Dataset

    if len(completions) != len(dataset) * num_samples:
        raise RuntimeError(f"teacher_traces: the cache holds {len(completions)} responses for {len(dataset)} prompts "
                           f"x {num_samples} samples; delete it to regenerate")
    records = []
    for index, row in enumerate(dataset):
        base = {k: v for k, v in row.items() if k != "completion"}
        records += [{**base, "completion": completions[index * num_samples + j]} for j in range(num_samples)]
    return Dataset.from_list(records)


def traces_dataset(rows, responses: list[list[str]], num_samples: int):
    """One row per (prompt, response): the prompt's other columns repeated, ``completion`` in the prompt's format."""
    from datasets import Dataset

    records = []
    for row, texts in zip(rows, responses, strict=True):
        if len(texts) != num_samples:
            raise RuntimeError(f"teacher_traces: expected {num_samples} responses per prompt, got {len(texts)}")
        base = {k: v for k, v in row.items() if k != "completion"}
        records += [{**base, "completion": gen.as_completion(row["prompt"], text)} for text in texts]
    return Dataset.from_list(records)


def _save_atomic(dataset, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        dataset.save_to_disk(str(staging))
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
