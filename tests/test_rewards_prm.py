"""prm / orm: step BCE at separators, Math-Shepherd MC labels, product/min aggregation, training recipe end to end."""

import json

import pytest
import torch

from trl_ext.catalog import Catalog
from trl_ext.recipe import StageSpec, load_raw, parse_recipe
from trl_ext.runner import run_recipe
from trl_ext.testing import check_plugin_conformance
from trl_ext.trainers.prm import IGNORE, step_bce_loss, tokenize_steps
from trl_ext_plugins.rewards import formulas
from trl_ext_plugins.rewards.orm import ORM, ORMParams
from trl_ext_plugins.rewards.prm import PRM, PRMParams, split_steps, step_probabilities
from trl_ext_plugins.rewards.steps import monte_carlo_step_labels, multistep_arithmetic


def test_step_bce_reads_only_labelled_positions():
    logits = torch.tensor([[0.3, -1.2, 2.0, 0.7], [1.5, 0.1, -0.4, 9.9]], dtype=torch.float64, requires_grad=True)
    labels = torch.full((2, 4), IGNORE, dtype=torch.float64)
    labels[0, 1], labels[0, 3], labels[1, 2] = 1.0, 0.375, 0.0
    loss = step_bce_loss(logits, labels)
    p = lambda x: 1 / (1 + torch.exp(-torch.tensor(x, dtype=torch.float64)))  # noqa: E731
    expected = -(torch.log(p(-1.2)) + 0.375 * torch.log(p(0.7)) + 0.625 * torch.log(1 - p(0.7))
                 + torch.log(1 - p(-0.4))) / 3
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    loss.backward()
    unlabelled = labels == IGNORE
    assert torch.all(logits.grad[unlabelled] == 0) and torch.all(logits.grad[~unlabelled] != 0)


def test_tokenize_steps_puts_labels_at_separators(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, positions = tokenize_steps(tok, "1+2+3=\n", ["1+2=3", "3+3=6"], "\n")
    assert tok.decode(ids) == "1+2+3=\n1+2=3\n3+3=6\n"
    assert [tok.decode([ids[i]]) for i in positions] == ["\n", "\n"] and positions == [12, 18]


def test_math_shepherd_mc_labels_with_a_scripted_completer():
    """N=8: 3 correct rollouts after step 1 -> soft 0.375, hard 1; 0/8 after step 2 -> both 0 (ALGORITHMS.md 11)."""
    outcomes = {"5=\n2+3=5\n": ["6"] * 3 + ["4"] * 5, "5=\n2+3=5\n5+1=7\n": ["7"] * 8}

    def completer(prefixes, n):
        return [outcomes[p][:n] for p in prefixes]

    steps = ["2+3=5", "5+1=7", "7+0=7"]
    soft = monte_carlo_step_labels("5=\n", steps, "6", completer, 8, soft=True)
    hard = monte_carlo_step_labels("5=\n", steps, "6", completer, 8, soft=False)
    assert soft == [0.375, 0.0, 0.0] and hard == [1.0, 0.0, 0.0]
    # the last step is labelled by the solution's own answer
    assert monte_carlo_step_labels("", ["2+4=6"], "6", completer, 8) == [1.0]


def test_embedded_stepwise_data_labels_match_the_arithmetic():
    data = multistep_arithmetic("train", size=64)
    for row in data:
        value = None
        ok = True
        for step, label in zip(row["completions"], row["labels"]):
            lhs, rhs = step.split("=")
            a, b = map(int, lhs.split("+"))
            ok = ok and (value is None or a == value) and a + b == int(rhs)
            assert label == float(ok), row
            value = int(rhs)
        assert (row["labels"][-1] == 1.0) == (str(value) == row["answer"])
    assert 0 < sum(r["labels"][-1] for r in data) < 64  # both kinds present


def test_aggregation_and_scoring_match_the_formula(tiny_model_dir):
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts, completions = ["1+2+3=\n", "4+4+1=\n"], ["1+2=3\n3+3=6", "4+4=8\n8+1=10\n"]
    steps = [split_steps(c, "\n") for c in completions]
    assert steps == [["1+2=3", "3+3=6"], ["4+4=8", "8+1=10"]]
    probs = step_probabilities(model, tok, prompts, steps, "\n", batch_size=1)
    batched = step_probabilities(model, tok, prompts, steps, "\n", batch_size=2)
    for a, b in zip(probs, batched):
        assert torch.allclose(a, b, atol=1e-6)
    ids, pos = tokenize_steps(tok, prompts[0], steps[0], "\n")
    with torch.no_grad():
        alone = torch.sigmoid(model(input_ids=torch.tensor([ids])).logits[0, pos, 0].double())
    assert torch.allclose(alone, probs[0], atol=1e-6)
    # plugin: product / min of step probabilities
    for how in ("product", "min"):
        plugin = PRM(PRMParams(path=tiny_model_dir, aggregation=how))
        plugin.scorer.model, plugin.scorer.tokenizer = model, tok
        (fn,) = plugin.trl_ext_reward_functions(StageSpec(trainer="grpo", model="x", dataset={"source": "x"}))
        got = fn.fn(prompts=prompts, completions=completions)
        want = [(p.prod() if how == "product" else p.min()).item() for p in probs]
        assert got == pytest.approx(want, abs=1e-6)
    assert formulas.aggregate_step_scores(torch.tensor([0.9, 0.8]), "product").item() == pytest.approx(0.72)


def test_orm_turns_unpaired_rows_into_one_step():
    from trl_ext.embedded.arithmetic import arithmetic_dataset

    stage = StageSpec(trainer="prm", model="x", dataset={"source": "x"})
    data = ORM(ORMParams()).trl_ext_prepare_dataset(arithmetic_dataset("train", format="unpaired", size=4), "train", stage)
    assert data[0]["completions"] == [data[0]["completions"][0]] and data["labels"] == [[1.0], [0.0], [1.0], [0.0]]
    with pytest.raises(ValueError, match="lacks column"):
        ORM(ORMParams(label_column="nope")).trl_ext_prepare_dataset(arithmetic_dataset("train", format="unpaired", size=4),
                                                                    "train", stage)


def test_validation_and_conformance():
    check_plugin_conformance(PRM)
    check_plugin_conformance(ORM)
    train = StageSpec(trainer="prm", model="x", dataset={"source": "x"})
    grpo = StageSpec(trainer="grpo", model="x", dataset={"source": "x"})
    assert PRM(PRMParams(label_source="mc_soft")).trl_ext_validate_stage(stage=train, plugins=[])
    assert PRM(PRMParams()).trl_ext_validate_stage(stage=grpo, plugins=[])
    assert not PRM(PRMParams(path="stage:prm")).trl_ext_validate_stage(stage=grpo, plugins=[])


def test_prm_recipe_end_to_end(tmp_path):
    """configs/prm.yaml, 3 PRM steps then 1 GRPO step scored by the trained PRM."""
    out = tmp_path / "run"
    info = run_recipe(parse_recipe(load_raw("configs/prm.yaml")), out, Catalog.discover(), max_steps=3,
                      echo=lambda _m: None)
    assert info["stages"]["prm"]["global_step"] == 3 and info["stages"]["prm"]["train_loss"] > 0
    assert json.loads((out / "prm" / "config.json").read_text())["architectures"] == ["Qwen2ForTokenClassification"]
    rows = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    scores = [r["rewards/prm/mean"] for r in rows if "rewards/prm/mean" in r]
    assert scores and all(0.0 <= s <= 1.0 for s in scores)
