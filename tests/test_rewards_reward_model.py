"""reward_model: BT training parity with TRL's RewardTrainer, batched scoring, stage refs, and the recipe end to end."""

import json

import pytest
import torch

from trl_ext.catalog import Catalog
from trl_ext.errors import RecipeError
from trl_ext.recipe import StageSpec, load_raw, parse_recipe
from trl_ext.runner import resolve_recipe, run_recipe
from trl_ext.testing import check_plugin_conformance
from trl_ext_plugins.rewards import formulas
from trl_ext_plugins.rewards.reward_model import RewardModel, RewardModelParams
from trl_ext_plugins.rewards.scoring import load_sequence_classifier, resolve_ref, run_dir_of, score_texts


def _preference_rows(n=8):
    from trl_ext.embedded.arithmetic import arithmetic_dataset

    data = arithmetic_dataset("train", format="preference", size=n)
    return data.add_column("gap", [0.25 * i for i in range(n)])


def test_bt_loss_matches_reward_trainer_float64(tiny_trainer):
    """Same batch, float64: formulas.bradley_terry_loss (+ centering, + margin) == RewardTrainer.compute_loss."""
    c = 0.1
    plugin = RewardModel(RewardModelParams(center_rewards_coefficient=c, margin_column="gap"))
    stage = StageSpec(trainer="reward", model="x", dataset={"source": "embedded:arithmetic"})
    data = plugin.trl_ext_prepare_dataset(_preference_rows(), "train", stage)
    assert "margin" in data.column_names and "gap" not in data.column_names
    trainer = tiny_trainer("reward", plugins=[plugin], dataset=data)
    assert trainer.args.center_rewards_coefficient == c  # set through trl_ext_configure_args
    model = trainer.model.double().eval()
    rows = [trainer.train_dataset[i] for i in range(8)]
    batch = trainer.data_collator(rows)
    assert "margin" in batch
    trl_loss = trainer.compute_loss(model, dict(batch)).item()

    with torch.no_grad():  # independent: each sequence alone, unpadded, reward at its last token
        def r(ids):
            return model(input_ids=torch.tensor([ids])).logits[0, 0]
        chosen = torch.stack([r(row["chosen_ids"]) for row in rows])
        rejected = torch.stack([r(row["rejected_ids"]) for row in rows])
    margin = torch.tensor([row["margin"] for row in rows], dtype=torch.float64)
    ours = formulas.bradley_terry_loss(chosen, rejected, margin).mean() + c * ((chosen + rejected) ** 2).mean()
    assert abs(ours.item() - trl_loss) < 1e-6
    # the margin matters (a test that could not tell margins apart would pass the line above by luck)
    assert abs(formulas.bradley_terry_loss(chosen, rejected).mean().item() + c * ((chosen + rejected) ** 2).mean().item()
               - trl_loss) > 1e-3


def test_missing_margin_column_is_a_clear_error():
    stage = StageSpec(trainer="reward", model="x", dataset={"source": "embedded:arithmetic"})
    with pytest.raises(ValueError, match="margin_column 'nope'"):
        RewardModel(RewardModelParams(margin_column="nope")).trl_ext_prepare_dataset(_preference_rows(), "train", stage)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A saved sequence-classification model (a causal-LM folder would get a fresh random head at every load)."""
    from trl_ext.embedded.models import materialize_model

    base = tmp_path_factory.mktemp("rm")
    torch.manual_seed(0)
    model, tok = load_sequence_classifier(str(materialize_model("tiny-qwen2", base / "lm", seed=0)))
    model.save_pretrained(base / "rm")
    tok.save_pretrained(base / "rm")
    return str(base / "rm")


def test_batched_scoring_equals_one_by_one_and_eos_convention(rm_dir):
    model, tok = load_sequence_classifier(rm_dir)
    texts = ["1+2=3", "12+34=46", "7=", "10+10=20<eos>", "3+4=77777"]
    one = score_texts(model, tok, texts, batch_size=1)
    batched = score_texts(model, tok, texts, batch_size=4)
    assert batched == pytest.approx(one, abs=1e-5)
    # eos is appended only where missing: "x" scores like "x<eos>", and not like bare "x"
    assert score_texts(model, tok, ["1+2=3"])[0] == pytest.approx(score_texts(model, tok, ["1+2=3<eos>"])[0], abs=1e-6)
    bare = score_texts(model, tok, ["1+2=3"], append_eos=False)[0]
    assert bare != pytest.approx(one[0], abs=1e-6)
    # independent reference for the appended-eos score: the last-token logit of the head on the unpadded ids
    ids = tok("1+2=3<eos>", add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(input_ids=ids).logits[0, 0].item() == pytest.approx(one[0], abs=1e-5)


def test_scoring_reads_the_ids_trls_reward_trainer_trains_on(tmp_path):
    """TRL 1.16's RewardTrainer tokenizes plain text with ``processing_class(text=...)`` after appending eos, and a
    conversation with ``apply_chat_template`` alone (no eos added). Scoring must give the head those same ids: an eos
    appended after a chat rendering moved the read position (Qwen3's template ends '<|im_end|>', '\\n')."""
    from trl.data_utils import _tokenize

    from trl_ext.embedded.models import materialize_model
    from trl_ext_plugins.rewards.scoring import LazyScorer

    torch.manual_seed(0)
    model, tok = load_sequence_classifier(str(materialize_model("tiny-qwen3-tools", tmp_path / "m", seed=0)))
    scorer = LazyScorer(lambda _run_dir: (model, tok))

    def head(ids):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0, 0].item()

    prompt, completion = [{"role": "user", "content": "1+2="}], [{"role": "assistant", "content": "3"}]
    assert scorer([prompt], [completion]) == pytest.approx([head(_tokenize(tok, prompt + completion)["input_ids"])],
                                                           abs=1e-5)
    plain = head(_tokenize(tok, "1+2=3" + tok.eos_token)["input_ids"])
    assert scorer(["1+2="], ["3"]) == pytest.approx([plain], abs=1e-5)


def test_plugin_scores_prompt_plus_completion_with_stage_ref(rm_dir, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(rm_dir, run / "rm")
    (run / "run.json").write_text(json.dumps({"recipe": {"seed": 0}}))
    (run / "grpo" / "checkpoints").mkdir(parents=True)
    assert run_dir_of(run / "grpo" / "checkpoints") == run.resolve()

    class FakeTrainer:
        class args:  # noqa: N801
            output_dir = str(run / "grpo" / "checkpoints")

    plugin = RewardModel(RewardModelParams(path="stage:rm", batch_size=2))
    plugin.trl_ext_trainer_created(FakeTrainer())
    stage = StageSpec(trainer="grpo", model="x", dataset={"source": "embedded:arithmetic"})
    (fn,) = plugin.trl_ext_reward_functions(stage)
    got = fn.fn(prompts=["1+2=", "5+5="], completions=["3", "11"], answer=["3", "10"])
    model, tok = load_sequence_classifier(rm_dir)
    assert got == pytest.approx(score_texts(model, tok, ["1+2=3", "5+5=11"]), abs=1e-6)
    with pytest.raises(FileNotFoundError, match="stage:missing"):
        resolve_ref("stage:missing", run)


def _recipe(stages):
    return parse_recipe({"seed": 0, "stages": stages})


def test_validation_errors_name_the_field():
    catalog = Catalog.discover()
    grpo = {"name": "g", "trainer": "grpo", "model": "embedded:tiny-qwen2",
            "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}},
            "plugins": ["grpo", {"reward_model": {"center_rewards_coefficient": 0.1}}]}
    with pytest.raises(RecipeError) as err:
        resolve_recipe(_recipe([grpo]), catalog)
    text = "\n".join(err.value.messages)
    assert "params.path is required" in text and "center_rewards_coefficient only applies" in text
    rm = {"name": "rm", "trainer": "reward", "model": "embedded:tiny-qwen2",
          "dataset": {"source": "embedded:arithmetic", "params": {"format": "preference"}},
          "plugins": [{"reward_model": {"path": "somewhere"}}]}
    with pytest.raises(RecipeError, match="params.path is for RL stages"):
        resolve_recipe(_recipe([rm]), catalog)


def test_conformance():
    check_plugin_conformance(RewardModel)


def test_recipe_trains_rm_then_grpo_uses_it(tmp_path):
    """configs/reward_model.yaml end to end (2 steps per stage): the GRPO stage's rewards come from the trained RM."""
    recipe = parse_recipe(load_raw("configs/reward_model.yaml"))
    out = tmp_path / "run"
    info = run_recipe(recipe, out, Catalog.discover(), max_steps=2, echo=lambda _m: None)
    assert info["status"] == "complete"
    config = json.loads((out / "rm" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    rows = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["rewards/reward_model/mean"] for r in rows if "rewards/reward_model/mean" in r]
    assert len(logged) == 2 and all(v == v for v in logged)
    # a freshly initialised head (the un-trained embedded model) would score differently: the trained RM was used
    trained, tok = load_sequence_classifier(str(out / "rm"))
    fresh, _ = load_sequence_classifier(str(out / "_embedded" / "tiny-qwen2"))
    text = ["1+2=3"]
    assert score_texts(trained, tok, text) != pytest.approx(score_texts(fresh, tok, text), abs=1e-4)
