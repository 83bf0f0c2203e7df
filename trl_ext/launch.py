"""Several processes from one command: the recipe's ``distributed:`` section -> a torchrun re-launch plus TRL args.

``trl-ext train recipe.yaml`` with ``distributed: {num_processes: 2}`` starts ``python -m torch.distributed.run
--nproc_per_node 2 -m trl_ext.cli train recipe.yaml ...`` itself; every rank then runs the ordinary CLI, builds the same
plugin host from the same recipe, and reads its rank from the environment torchrun sets. The backend is expressed the
way Hugging Face's Trainer takes it, as training arguments, so TRL's own trainers (and accelerate under them) do the
sharding:

======== ==============================================================================================
backend  TRL/transformers arguments added to every stage (a stage's own ``args`` win where it sets them)
======== ==============================================================================================
ddp      none (DistributedDataParallel is what accelerate does with several processes)
zero2    ``deepspeed``: a ZeRO stage-2 config with ``"auto"`` sizes (needs ``pip install 'trl-ext[deepspeed]'``)
zero3    ``deepspeed``: a ZeRO stage-3 config, 16-bit weights gathered on save
fsdp2    ``fsdp: "full_shard auto_wrap"``, ``fsdp_config: {version: 2}`` (PyTorch FSDP2)
======== ==============================================================================================

On a machine without CUDA, ranks run on the CPU with gloo (``use_cpu: true`` is added: without it every rank
believes it is alone and trains its own copy into the same folder). ``fsdp2`` needs CUDA and is refused without it
(``trl_ext.runner.check_distributed``): accelerate enables FSDP only for GPU process groups, so CPU ranks would
silently train unsharded under DDP.

Already inside a launched job (``WORLD_SIZE`` set, e.g. under ``accelerate launch`` or ``torchrun``) nothing is
re-launched: the section's backend arguments still apply. Multi-node: run the same command on every machine with
``num_machines``, ``machine_rank`` (or ``--machine-rank``), ``main_process_ip`` and ``main_process_port``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

# DeepSpeed configs in the Trainer's "auto" style: the Trainer fills batch sizes, accumulation and clipping from the
# TRL config, so one config serves every stage.
_ZERO_BASE: dict[str, Any] = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
}


def backend_args(backend: str, cuda: bool) -> dict[str, Any]:
    """TRL config fields that select ``backend`` (see the module table). Pure: no import of the backend."""
    args: dict[str, Any] = {}
    if backend == "zero2":
        args["deepspeed"] = {**_ZERO_BASE, "zero_optimization": {"stage": 2}}
    elif backend == "zero3":
        args["deepspeed"] = {**_ZERO_BASE, "zero_optimization": {
            "stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    elif backend == "fsdp2":
        args["fsdp"] = "full_shard auto_wrap"
        args["fsdp_config"] = {"version": 2}
    if not cuda:
        args["use_cpu"] = True
    return args


def already_launched(environ: dict[str, str] | None = None) -> bool:
    """True inside a torchrun/accelerate job (the launcher sets WORLD_SIZE for every rank)."""
    environ = os.environ if environ is None else environ
    return "WORLD_SIZE" in environ


def launch_command(spec, cli_args: list[str], machine_rank: int | None = None) -> list[str]:
    """The torchrun command that re-runs ``trl-ext <cli_args>`` on ``spec.num_processes`` processes per machine."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(spec.num_processes)]
    if spec.num_machines > 1:
        rank = spec.machine_rank if machine_rank is None else machine_rank
        command += ["--nnodes", str(spec.num_machines), "--node_rank", str(rank),
                    "--master_addr", spec.main_process_ip, "--master_port", str(spec.main_process_port)]
    else:
        # A free port per job, so two single-machine runs on one host do not collide on torchrun's default port.
        command += ["--master_port", str(spec.main_process_port or _free_port())]
    return command + ["-m", "trl_ext.cli", *cli_args]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def relaunch(spec, cli_args: list[str], machine_rank: int | None = None) -> int:
    """Run the launched job in the foreground and return its exit code (the ranks' output goes to this terminal)."""
    import subprocess

    return subprocess.call(launch_command(spec, cli_args, machine_rank))


def init_cpu_deepspeed(stage_args: list[dict[str, Any]]) -> None:
    """Start DeepSpeed's process group with gloo before any model is built, on a CPU-only machine.

    Under ZeRO-3, transformers builds models inside ``deepspeed.zero.Init``, which would otherwise initialise
    DeepSpeed's communication itself with a GPU backend, or see a world of one process (then every batch-size
    check fails with ``train_batch_size ... world_size 1``). No-op with CUDA, without DeepSpeed configs, or when a
    process group exists.
    """
    import torch

    if torch.cuda.is_available() or not already_launched() or not any(args.get("deepspeed") for args in stage_args):
        return
    import deepspeed

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
