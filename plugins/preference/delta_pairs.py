"""``delta_pairs``: preference pairs with the chosen side from a stronger model and the rejected side from a weaker one."""

from __future__ import annotations

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext_plugins.preference import generation as gen
from trl_ext_plugins.preference.common import PreferenceDataError


class DeltaPairsParams(PluginParams):
    strong: str = Field(..., description="Model writing the chosen responses: a path or hub id, `embedded:<name>` or "
                                         "`stage:<name>` (an earlier stage's output).")
    weak: str = Field(..., description="Model writing the rejected responses (same forms as `strong`); the paper "
                                       "pairs it so it is clearly weaker (e.g. Qwen-2.5-1.5B vs 3B).")
    max_new_tokens: int = Field(64, gt=0, description="Generation length limit for both models.")
    do_sample: bool = Field(False, description="Sample instead of greedy decoding (false: greedy, deterministic).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (only with do_sample).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (only with do_sample).")
    seed: int = Field(0, description="Sampling seed (only with do_sample).")
    batch_size: int = Field(64, gt=0, description="Prompts per generate() call.")
    cache_dir: str | None = Field(None, description="Where the pair datasets are cached; default "
                                                    "`<run output_dir>/_cache/delta_pairs`.")
    splits: list[str] = Field(["train"], description="Dataset splits (train, eval) turned into pairs.")


class DeltaPairs(Plugin):
    """Delta learning (Geng et al., COLM 2025, arXiv 2507.06187): DPO on pairs whose *difference* is informative.

    For every prompt of the stage's dataset, ``chosen`` is the response of the ``strong`` model and ``rejected`` the
    response of the ``weak`` model; no judge. The loss is whatever the stage's DPO trainer uses (TRL's sigmoid DPO by
    default, or a preference-loss plugin; the paper used Tülu 3's length-normalised DPO). Defaults: greedy decoding
    (deterministic, so a rerun with the same models hits the cache), ``max_new_tokens`` 64. Other columns of the
    dataset (e.g. ``answer``) are kept; a prompt whose two responses are identical carries no preference and is
    dropped (the count is logged); an all-identical result is an error. The pairs are generated on the main process
    and cached as a dataset keyed by a hash of both models (file sizes and mtimes), the prompts and the generation
    settings, so a rerun reuses them; the other processes wait and load the cache.
    """

    name = "delta_pairs"
    family = "preference"
    trainers = frozenset({"dpo"})
    Params = DeltaPairsParams

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        if split not in self.params.splits:
            return None
        if "prompt" not in dataset.column_names:
            raise PreferenceDataError(f"delta_pairs: {split} dataset lacks column 'prompt' "
                                      f"(has: {', '.join(dataset.column_names)})")
        strong, weak = gen.resolve_model(self.params.strong, self.name), gen.resolve_model(self.params.weak, self.name)
        settings = self.params.model_dump(exclude={"strong", "weak", "cache_dir", "splits"})
        key = gen.cache_key({"strong": gen.model_fingerprint(strong), "weak": gen.model_fingerprint(weak),
                             "prompts": list(dataset["prompt"]), "settings": settings})
        pairs, hit = gen.cached_dataset(gen.cache_root(self.params.cache_dir, self.name), key,
                                        lambda: self._generate(dataset, strong, weak))
        gen.logger.info("delta_pairs: %s split: %d pairs (%s)", split, len(pairs),
                        "cache hit" if hit else "generated")
        return pairs

    def _generate(self, dataset, strong: str, weak: str):
        settings = dict(max_new_tokens=self.params.max_new_tokens, do_sample=self.params.do_sample,
                        temperature=self.params.temperature, top_p=self.params.top_p,
                        batch_size=self.params.batch_size, seed=self.params.seed)
        prompts = dataset["prompt"]
        responses = {}
        for side, path in (("chosen", strong), ("rejected", weak)):
            model, tokenizer = gen.load_policy(path)
            responses[side] = [s[0] for s in gen.sample_completions(model, tokenizer, prompts, **settings)]
            del model
        return build_pairs(dataset, responses["chosen"], responses["rejected"])


def build_pairs(dataset, chosen: list[str], rejected: list[str]):
    """Add ``chosen``/``rejected`` to ``dataset`` and drop rows where they are equal (count logged; none left: error)."""
    keep = [i for i, (c, r) in enumerate(zip(chosen, rejected, strict=True)) if c != r]
    dropped = len(chosen) - len(keep)
    if dropped:
        gen.logger.warning("delta_pairs: dropped %d of %d pairs whose chosen and rejected responses are identical",
                           dropped, len(chosen))
    if not keep:
        raise PreferenceDataError(f"delta_pairs: all {len(chosen)} pairs have identical chosen and rejected "
                                  "responses; the strong and weak models must differ")
    prompts = dataset["prompt"]
    base = dataset.remove_columns([c for c in ("chosen", "rejected") if c in dataset.column_names])
    base = base.add_column("chosen", [gen.as_completion(p, c) for p, c in zip(prompts, chosen)])
    base = base.add_column("rejected", [gen.as_completion(p, r) for p, r in zip(prompts, rejected)])
    return base.select(keep)
