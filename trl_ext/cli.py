"""The ``trl-ext`` command line.

    trl-ext train RECIPE [--output-dir DIR] [--max-steps N] [--set PATH=VALUE ...]
    trl-ext validate RECIPE [--set PATH=VALUE ...]
    trl-ext plugins list [--json]
    trl-ext plugins show NAME

Several processes: a recipe's ``distributed:`` section makes ``trl-ext train`` start them itself (trl_ext/launch.py);
``torchrun --nproc_per_node N -m trl_ext.cli train RECIPE`` or ``accelerate launch --multi_gpu --num_processes N -m
trl_ext.cli train RECIPE`` work too. Every rank builds the same plugin host from the recipe.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trl_ext.errors import RecipeError, TrlExtError


def _load_recipe(path: str, overrides: list[str]):
    from trl_ext.recipe import apply_overrides, load_raw, parse_recipe

    return parse_recipe(apply_overrides(load_raw(path), overrides or []))


def cmd_validate(ns) -> int:
    from trl_ext.catalog import Catalog
    from trl_ext.runner import resolve_recipe

    recipe = _load_recipe(ns.recipe, ns.set)
    resolved = resolve_recipe(recipe, Catalog.discover())
    for rs in resolved:
        print(f"stage {rs.spec.name!r}: trainer={rs.spec.trainer} plugins={rs.host.names() or 'none'}")
    print(f"{ns.recipe}: valid")
    return 0


def cmd_train(ns) -> int:
    from trl_ext.catalog import Catalog
    from trl_ext.runner import run_recipe

    recipe = _load_recipe(ns.recipe, ns.set)
    output_dir = ns.output_dir or recipe.output_dir or str(Path("runs") / Path(ns.recipe).stem)
    spec = recipe.distributed
    if spec is not None and spec.num_processes * spec.num_machines > 1:
        from trl_ext.launch import already_launched, relaunch
        from trl_ext.runner import resolve_recipe

        if not already_launched():
            resolve_recipe(recipe, Catalog.discover(), max_steps=ns.max_steps)  # report recipe errors once, here
            return relaunch(spec, ns.argv, machine_rank=ns.machine_rank)
    try:
        run_recipe(recipe, output_dir, Catalog.discover(), max_steps=ns.max_steps)
    finally:
        _close_process_group()
    return 0


def _close_process_group() -> None:
    """Tear down torch.distributed before interpreter exit: gloo's threads otherwise sometimes abort the process at
    shutdown ("terminate called without an active exception") after all work is done."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def cmd_plugins_list(ns) -> int:
    from trl_ext.catalog import Catalog

    catalog = Catalog.discover()
    rows = [
        {
            "name": info.name,
            "aliases": list(info.cls.aliases),
            "version": info.version,
            "distribution": info.distribution,
            "family": info.cls.family,
            "slots": sorted(s.value for s in info.cls.slots),
            "hooks": info.cls.implemented_hooks(),
            "status": "loaded",
        }
        for info in sorted(catalog.plugins.values(), key=lambda i: (i.cls.family, i.name))
    ]
    rows += [
        {"name": f.source, "aliases": [], "version": "?", "distribution": f.distribution, "family": "?",
         "slots": [], "hooks": [], "status": f"error: {f.error}"}
        for f in catalog.failures
    ]
    if ns.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = f"{'name':<22}{'family':<13}{'distribution':<22}{'version':<9}{'status':<8} hooks"
    print(header)
    print("-" * len(header))
    for row in rows:
        hooks = ", ".join(h.removeprefix("trl_ext_") for h in row["hooks"])
        print(f"{row['name']:<22}{row['family']:<13}{row['distribution']:<22}{row['version']:<9}"
              f"{row['status'] if row['status'] == 'loaded' else 'ERROR':<8} {hooks}")
        if row["status"] != "loaded":
            print(f"{'':<22}{row['status']}")
    return 0


def cmd_plugins_show(ns) -> int:
    from trl_ext.catalog import Catalog

    info = Catalog.discover().resolve(ns.name)
    cls = info.cls
    print(f"{cls.name}  ({info.distribution} {info.version}, family {cls.family})")
    if cls.aliases:
        print(f"aliases: {', '.join(cls.aliases)}")
    print()
    print(cls.__doc__.strip() if cls.__doc__ else "(no description)")
    print()
    print(f"trainers: {', '.join(sorted(cls.trainers)) or 'any'}")
    print(f"slots:    {', '.join(sorted(s.value for s in cls.slots)) or 'none'}")
    print(f"needs:    {', '.join(sorted(n.value for n in cls.needs)) or 'none'}")
    print(f"hooks:    {', '.join(cls.implemented_hooks())}")
    if cls.requires:
        print(f"requires: {', '.join(requirement for _module, requirement in cls.requires)}")
    print("parameters:")
    table = cls.parameter_table()
    if not table:
        print("  (none)")
    for row in table:
        default = "required" if row["required"] else f"default {row['default']!r}"
        print(f"  {row['name']} ({row['type']}, {default}): {row['description']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-ext", description="Post-training recipes on TRL trainers, with plugins.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a recipe")
    train.add_argument("recipe")
    train.add_argument("--output-dir", help="where stages, metrics and run.json go (default: recipe's or runs/NAME)")
    train.add_argument("--max-steps", type=int, help="cap every stage at N optimizer steps (smoke runs)")
    train.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                       help="override a recipe field, e.g. stages.sft.args.learning_rate=1e-4 (repeatable)")
    train.add_argument("--machine-rank", type=int, help="this machine's rank in a multi-machine `distributed:` run")
    train.set_defaults(func=cmd_train)

    validate = sub.add_parser("validate", help="check a recipe without loading any model")
    validate.add_argument("recipe")
    validate.add_argument("--set", action="append", default=[], metavar="PATH=VALUE")
    validate.set_defaults(func=cmd_validate)

    plugins = sub.add_parser("plugins", help="list or describe installed plugins")
    psub = plugins.add_subparsers(dest="plugins_command", required=True)
    plist = psub.add_parser("list", help="installed plugins with version, distribution, family, hooks, status")
    plist.add_argument("--json", action="store_true")
    plist.set_defaults(func=cmd_plugins_list)
    pshow = psub.add_parser("show", help="a plugin's description, parameters and needs")
    pshow.add_argument("name")
    pshow.set_defaults(func=cmd_plugins_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    ns.argv = list(sys.argv[1:] if argv is None else argv)  # re-used verbatim when `distributed:` re-launches
    try:
        return ns.func(ns)
    except RecipeError as exc:
        print("error: invalid recipe", file=sys.stderr)
        for message in exc.messages:
            print(f"  {message}", file=sys.stderr)
        return 2
    except TrlExtError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
