"""``bond``: BoN log-density advantages by hand, the forward (SFT on best-of-N) term, the EMA anchor, bad input."""

import math

import pytest
import torch

from trl_ext.errors import RecipeError
from trl_ext.recipe import StageSpec
from trl_ext.stage import resolve_stage
from trl_ext_plugins.distill import math as dm
from trl_ext_plugins.distill.bond import BEST_KEY, BOND, BONDParams, best_in_group, bon_nll, bond_advantages
from tests.markers import NEEDS_DEEPSPEED


def test_advantages_by_hand():
    # rewards [1, 0, 1, 0]: p_le = [1, .5, 1, .5], log p_le = [0, -ln2, 0, -ln2], group mean -ln2/2;
    # beta (N-1) = 0.5 * 3 = 1.5 -> +-1.5 ln2 / 2 = +-0.519860
    adv = bond_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4, 4, 0.5)
    assert adv.tolist() == pytest.approx([0.519860, -0.519860, 0.519860, -0.519860], abs=1e-6)
    assert bond_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4, 4, 0.0).abs().max() == 0  # beta 0: no RL part
    assert bond_advantages(torch.full((4,), 3.0), 4, 4, 0.5).abs().max() == 0  # all tied: p_le = 1 everywhere


def test_best_of_group_and_nll_gradient_only_through_best_samples():
    assert best_in_group(torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 2.0, 2.0, 1.0]), 4).tolist() == [1, 0, 0, 0,
                                                                                                  0, 1, 0, 0]
    logps = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.1]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])  # row 0 is the best sample
    nll = bon_nll(logps, mask)
    assert nll.item() == pytest.approx((math.log(2) + math.log(4)) / 2, abs=1e-6)  # 1.039721
    nll.backward()
    assert logps.grad[1].abs().max() == 0 and logps.grad[0].tolist() == [-0.5, -0.5]


def scripted(values):
    def reward(completions, **kwargs):
        return values[: len(completions)]

    return reward


def rollout(trainer, rows=8):
    trainer.model.train()
    return trainer._generate_and_score_completions([trainer.train_dataset[i // 4] for i in range(rows)])


def test_on_grpo_trainer(tiny_trainer):
    values = [1.0, 0.0, 1.0, 0.0, 0.0, 2.0, 2.0, 1.0]
    trainer = tiny_trainer("grpo", plugins=[BOND()], reward_funcs=[scripted(values)])
    assert trainer.beta == 0.5  # KL coefficient beta * 1 to the anchor
    out = rollout(trainer)
    expected = bond_advantages(torch.tensor(values), 4, 4, 0.5)
    assert torch.allclose(out["advantages"], expected, atol=1e-6)
    assert out[BEST_KEY].tolist() == [1, 0, 0, 0, 0, 1, 0, 0]


def test_ema_anchor_moves_the_reference(tiny_trainer):
    trainer = tiny_trainer("grpo", plugins=[BOND(BONDParams(anchor="ema", ema_rate=0.25))],
                           args={"max_steps": 1, "learning_rate": 1e-2})
    name, initial = next((n, p.detach().clone()) for n, p in trainer.model.named_parameters() if "layers.0" in n)
    trainer.train()
    policy = dict(trainer.model.named_parameters())[name].detach()
    anchor = dict(trainer.ref_model.named_parameters())[name].detach()
    assert not torch.equal(policy, initial)
    assert torch.allclose(anchor, 0.75 * initial + 0.25 * policy, atol=1e-6)


def test_n_must_match_the_group_size(trl_ext_catalog, tiny_model_dir):
    from trl_ext_plugins.rewards.exact_match import ExactMatch

    trl_ext_catalog.add_plugin(BOND)
    trl_ext_catalog.add_plugin(ExactMatch)
    stage = StageSpec(trainer="grpo", model=tiny_model_dir, dataset={"source": "embedded:arithmetic"},
                      args={"num_generations": 4}, plugins=[{"bond": {"n": 8}}, "exact_match"])
    with pytest.raises(RecipeError, match="params.n=8 must equal args.num_generations"):
        resolve_stage(stage, 0, trl_ext_catalog)


def test_ema_anchor_under_peft_is_refused(trl_ext_catalog, tiny_model_dir):
    """Under PEFT TRL's GRPO keeps no reference model (ref_model is None: the adapter is disabled instead), so the
    EMA callback had nothing to move and the anchor silently stayed the initial policy."""
    from trl_ext_plugins.rewards.exact_match import ExactMatch

    trl_ext_catalog.add_plugin(BOND)
    trl_ext_catalog.add_plugin(ExactMatch)

    def stage(anchor):
        return StageSpec(trainer="grpo", model=tiny_model_dir, dataset={"source": "embedded:arithmetic"},
                         args={"num_generations": 4}, plugins=[{"bond": {"anchor": anchor}}, "exact_match"],
                         peft={"type": "lora"})

    with pytest.raises(RecipeError, match="anchor 'ema' needs a full reference model"):
        resolve_stage(stage("ema"), 0, trl_ext_catalog)
    # the fixed reference works under PEFT (TRL scores it with the adapter disabled)
    resolve_stage(stage("reference"), 0, trl_ext_catalog)


def test_unscorable_samples_stay_out_of_the_estimates():
    """A NaN reward counted as the worst one: it took the most negative advantage and raised the other samples' p_le.
    Now the scorable samples get what they get without it, the NaN sample 0, and it is never the best."""
    nan = float("nan")
    adv = bond_advantages(torch.tensor([nan, 1.0, 0.0, 1.0]), 4, 4, 0.5)
    # scorable rewards [1, 0, 1]: p_le = [1, 1/3, 1]; log mean = -ln(3)/3; 0.5 * 3 * (log p_le - mean)
    third = math.log(3.0) / 3.0
    assert adv.tolist() == pytest.approx([0.0, 1.5 * third, 1.5 * (third - math.log(3.0)), 1.5 * third])
    assert adv.tolist() == pytest.approx([0.0, *bond_advantages(torch.tensor([1.0, 0.0, 1.0]), 3, 4, 0.5).tolist()])
    assert dm.group_p_le(torch.tensor([nan, 1.0, 0.0, 1.0]), 4)[1:].tolist() == pytest.approx([1.0, 1 / 3, 1.0])
    assert best_in_group(torch.tensor([nan, 0.0, 2.0, nan, nan, nan, nan, nan]), 4).tolist() == [0, 0, 1, 0,
                                                                                                  0, 0, 0, 0]
    assert bond_advantages(torch.full((4,), nan), 4, 4, 0.5).tolist() == [0.0] * 4


def test_bon_nll_is_a_token_mean_over_every_ranks_best_samples():
    """The forward part was a token mean over this rank's micro-batch: with the group's best sample on rank 0 of 2,
    rank 1 added 0 and data parallel's gradient average halved the term (1.0 on one process, 0.5 on two). The default
    now divides by the best samples' tokens of the whole generation batch."""
    import dataclasses

    from test_losses import make_inputs

    logps = [[math.log(0.5), math.log(0.25)], [math.log(0.1), math.log(0.1)]]
    best, other = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])
    plugin = BOND(BONDParams(beta=0.0))  # the forward part alone, weight 1
    expected = (math.log(2) + math.log(4)) / 2  # the 2 best tokens, whichever rank holds them
    rank0 = dataclasses.replace(make_inputs(logps, bond_best=best, bond_best_tokens=torch.full((2,), 2.0)),
                                num_processes=2)
    rank1 = dataclasses.replace(make_inputs(logps, bond_best=other, bond_best_tokens=torch.full((2,), 2.0)),
                                num_processes=2)
    averaged = (plugin.trl_ext_extra_loss(rank0) + plugin.trl_ext_extra_loss(rank1)) / 2  # DDP's gradient average
    assert averaged.item() == pytest.approx(expected)
    one_process = plugin.trl_ext_extra_loss(make_inputs(logps, bond_best=best, bond_best_tokens=torch.full((2,), 2.0)))
    assert one_process.item() == pytest.approx(expected)
    per_rank = BOND(BONDParams(beta=0.0, bon_nll_mean="micro_batch"))
    assert ((per_rank.trl_ext_extra_loss(rank0) + per_rank.trl_ext_extra_loss(rank1)) / 2).item() == \
        pytest.approx(expected / 2)  # the per-rank convention, kept as an option


@pytest.mark.slow
@NEEDS_DEEPSPEED
def test_ema_anchor_under_zero3_moves_and_resumes_as_on_one_process(tmp_path):
    """ZeRO-3 keeps each parameter as this rank's partition (``.data`` empty): the EMA update crashed at the first step
    (size 0 against the policy's persistent small tensors) and the checkpointed anchor was written as size-0 tensors.
    Now 2 processes under ZeRO-3, killed after their second checkpoint and resumed from the first, end with the anchor
    one process reaches on the same global batch (fixed completions, tests/fixed_rollouts_cli.py)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    script = Path(__file__).resolve().parent / "fixed_rollouts_cli.py"

    def recipe(per_device: int, distributed: dict | None) -> Path:
        data = {"seed": 0, "name": "bond", "trainer": "grpo", "model": "embedded:tiny-qwen2", "keep_checkpoints": True,
                "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}, "limit": 64},
                "plugins": [{"bond": {"anchor": "ema", "ema_rate": 0.5}}, "fixed_rollouts",
                            {"python_reward": {"functions": f"{script}:completion_length"}}],
                "args": {"max_steps": 2, "per_device_train_batch_size": per_device, "learning_rate": 0.1,
                         "optim": "sgd", "logging_steps": 1, "save_strategy": "steps", "save_steps": 1,
                         "gradient_checkpointing": False, "num_generations": 4, "max_completion_length": 8},
                **({"distributed": distributed} if distributed else {})}
        path = tmp_path / f"bond{per_device}.json"
        path.write_text(json.dumps(data))
        return path

    def run(command: list[str], out: Path, crash_at: str | None = None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "TRL_EXT_CRASH_AT"}
        if crash_at:
            env["TRL_EXT_CRASH_AT"] = crash_at
        return subprocess.run([*command, "train", str(out.with_suffix(".json")), "--output-dir", str(out)],
                              check=False, capture_output=True, text=True, timeout=900, env=env)

    one = recipe(8, None).with_suffix("")
    two = recipe(4, {"num_processes": 2, "backend": "zero3"}).with_suffix("")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29617"]
    single = run([sys.executable, str(script)], one)
    assert single.returncode == 0, single.stderr[-3000:]
    killed = run([*torchrun, str(script)], two, crash_at="checkpoint:2")  # 2nd checkpoint written, unmarked
    assert killed.returncode != 0 and not (two / "bond" / "stage.json").exists(), killed.stderr[-3000:]
    resumed = run([*torchrun, str(script)], two)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout

    def anchor(out: Path, step: int) -> dict:
        return load_file(str(out / "bond" / "checkpoints" / f"checkpoint-{step}" / "ema_anchor.safetensors"))

    initial = load_file(str(next((one / "_embedded").glob("*")) / "model.safetensors"))
    reference = anchor(one, 2)
    assert max((reference[k] - initial[k]).abs().max().item() for k in reference if k in initial) > 1e-3  # moved
    for step in (1, 2):
        sharded, expected = anchor(two, step), anchor(one, step)
        assert {k: v.shape for k, v in sharded.items()} == {k: v.shape for k, v in expected.items()}
        assert max((sharded[k] - expected[k]).abs().max().item() for k in expected) < 1e-6, step
