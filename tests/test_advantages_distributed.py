"""GAE and global-batch whitening give the same numbers on 2 CPU processes (torchrun, gloo) as on one."""

import json
import os
import socket
import subprocess
import sys
import textwrap


WORKER = textwrap.dedent('''
    import json, sys, types
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from trl_ext.batches import RolloutBatch
    from trl_ext_plugins.advantages import math as adv
    from trl_ext_plugins.advantages.reinforce_pp import ReinforcePPBaseline

    def data():
        g = torch.Generator().manual_seed(0)
        n, t = 8, 6
        lengths = torch.tensor([6, 1, 4, 3, 6, 2, 5, 0])
        mask = (torch.arange(t) < lengths.unsqueeze(1)).double()
        return (torch.randn(n, t, dtype=torch.float64, generator=g), torch.randn(n, t, dtype=torch.float64, generator=g),
                mask, torch.tensor([1., 0., 0., 1., 0.5, 0., 1., 0.]))

    def compute(rows, reduce, trainer):
        rewards, values, mask, seq_rewards = data()
        lam = adv.length_adaptive_lambda(mask.sum(1), alpha=0.4)[rows]
        a, ret = adv.gae(rewards[rows], values[rows], mask[rows], gamma=0.99, lam=lam)
        w = adv.masked_whiten(a, mask[rows], reduce)
        batch = RolloutBatch(rewards_per_func=seq_rewards.unsqueeze(1), reward_names=["r"], reward_weights=torch.ones(1),
                             num_generations=2, process_slice=rows, completion_ids=torch.zeros_like(mask[rows]).long(),
                             completion_mask=mask[rows], completion_lengths=mask.sum(1), prompts=[], completions=[],
                             inputs=[], trainer=trainer)
        pp = ReinforcePPBaseline().trl_ext_compute_advantages(rewards=seq_rewards.float(), batch=batch)
        return {"gae": a.tolist(), "returns": ret.tolist(), "whitened": w.tolist(), "reinforce_pp_baseline": pp.tolist()}

    if __name__ == "__main__":
        acc = Accelerator(cpu=True)
        rank, world = acc.process_index, acc.num_processes
        assert world == 2 and dist.get_backend() == "gloo"
        rows = slice(rank * 4, (rank + 1) * 4)
        mine = compute(rows, adv.torch_distributed_sum, types.SimpleNamespace(accelerator=acc))
        parts = [None] * world
        dist.all_gather_object(parts, mine)
        if rank == 0:
            print(json.dumps({k: parts[0][k] + parts[1][k] for k in mine}))
        # Tear gloo down before exit: its threads otherwise sometimes abort the process at interpreter shutdown.
        dist.barrier()
        dist.destroy_process_group()
''')


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    import torch

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    torchrun = [sys.executable, "-m", "torch.distributed.run"]  # this interpreter's torch, whatever its bin/ holds
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*torchrun, "--nproc_per_node", "2", "--master_port", str(_free_port()), str(script)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    double = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])

    namespace = {}
    exec(compile(WORKER, "worker", "exec"), namespace)  # the same code, one process, no reduction
    single = namespace["compute"](slice(0, 8), None, None)
    for key, value in single.items():
        assert torch.allclose(torch.tensor(double[key]), torch.tensor(value), atol=1e-6), key
    # not trivially equal: whitening changed the GAE advantages, and the whitened tokens are global-batch normalised
    whitened = torch.tensor(single["whitened"])
    assert not torch.allclose(whitened, torch.tensor(single["gae"]))
    half_alone = torch.tensor(namespace["compute"](slice(0, 4), None, None)["whitened"])
    assert not torch.allclose(half_alone, torch.tensor(double["whitened"][:4]), atol=1e-3)  # statistics were global
