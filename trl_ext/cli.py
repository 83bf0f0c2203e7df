"""The ``trl-ext`` command line.

    trl-ext train RECIPE [--output-dir DIR] [--max-steps N] [--set PATH=VALUE ...]
    trl-ext validate RECIPE [--set PATH=VALUE ...]
    trl-ext train|validate TRL_CONFIG --trl grpo|sft|dpo|...   (a file `trl grpo --config` takes)
    trl-ext convert grpo TRL_CONFIG                             (print the equivalent recipe)
    trl-ext models | datasets [--json]                          (built-in embedded:<name> models and datasets)
    trl-ext plugins list [--json]
    trl-ext plugins show NAME

Global options (before or after the subcommand): ``--debug`` prints the traceback of any error; ``-p no:NAME`` skips
a plugin entry point or distribution (repeatable). ``train --restart-unfinished`` deletes an unfinished stage of a
different recipe in the output directory instead of refusing. ``validate`` takes ``--output-dir`` and ``--max-steps``
to check exactly what ``train`` would.

Exit codes: 0 success; 2 usage and validation errors (bad recipe, arguments or output directory, a directory in use
by another run; one line per problem, no traceback); 1 runtime failures (one line; ``--debug`` shows the traceback).

Several processes: a recipe's ``distributed:`` section makes ``trl-ext train`` start them itself (trl_ext/launch.py);
``torchrun --nproc_per_node N -m trl_ext.cli train RECIPE`` or ``accelerate launch --multi_gpu --num_processes N -m
trl_ext.cli train RECIPE`` work too. Every rank builds the same plugin host from the recipe.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from trl_ext.errors import RecipeError, TrlExtError

EXIT_RUNTIME = 1
EXIT_USAGE = 2


def _load_recipe(path: str, overrides: list[str], trl_command: str | None = None):
    from trl_ext.recipe import apply_overrides, load_raw, parse_recipe
    from trl_ext.trl_config import convert, looks_like_trl_config

    data = load_raw(path)
    if trl_command is not None:
        data = convert(trl_command, data, source=path)
    elif looks_like_trl_config(data):
        raise RecipeError(f"{path}: this is a TRL config file (model_name_or_path, no trainer); add --trl "
                          f"sft|grpo|rloo|dpo|kto|reward, or see it as a recipe with `trl-ext convert COMMAND {path}`")
    recipe = parse_recipe(apply_overrides(data, overrides or []))
    recipe._source_file = Path(path)
    return recipe


def cmd_convert(ns) -> int:
    """Print the recipe equivalent to a TRL config file (``trl COMMAND --config FILE``)."""
    import yaml

    from trl_ext.recipe import load_raw
    from trl_ext.trl_config import convert

    recipe = convert(ns.command_name, load_raw(ns.config), source=ns.config)
    print(f"# Run: trl-ext train RECIPE.yaml   (converted from `trl {ns.command_name} --config {ns.config}`)")
    print(yaml.safe_dump(recipe, sort_keys=False), end="")
    return 0


def _catalog(ns):
    """The installed plugins minus ``-p no:NAME``; entry points that failed to load are reported, not fatal."""
    from trl_ext.catalog import Catalog

    catalog = Catalog.discover(block=set(ns.disabled_plugins))
    for failure in catalog.failures:
        print(f"warning: plugin entry point {failure.source!r} of distribution {failure.distribution!r} failed to "
              f"load and is skipped: {failure.error} (silence with -p no:{failure.source})", file=sys.stderr)
    return catalog


def _output_dir(ns, recipe) -> str:
    from trl_ext.recipe import default_output_dir

    if ns.output_dir is not None and not ns.output_dir.strip():  # "" fell back to the recipe's folder, silently
        raise RecipeError("--output-dir: empty; give a folder, or leave the option out for the recipe's output_dir")
    return ns.output_dir or recipe.output_dir or str(default_output_dir(ns.recipe))


def cmd_validate(ns) -> int:
    from trl_ext.runner import check_output_dir, preflight, stage_fingerprints

    recipe = _load_recipe(ns.recipe, ns.set, ns.trl)
    output_dir = _output_dir(ns, recipe)
    resolved = preflight(recipe, _catalog(ns), output_dir, max_steps=ns.max_steps,
                         warn=lambda message: print(f"warning: {message}", file=sys.stderr))
    # what train checks next: an output directory holding another recipe's stages is refused (nothing is removed here)
    check_output_dir(Path(output_dir), stage_fingerprints(resolved))
    for rs in resolved:
        print(f"stage {rs.spec.name!r}: trainer={rs.spec.trainer} plugins={rs.host.names() or 'none'}")
    print(f"{ns.recipe}: valid")
    return 0


def cmd_train(ns) -> int:
    from trl_ext.runner import preflight, run_recipe

    recipe = _load_recipe(ns.recipe, ns.set, ns.trl)
    output_dir = _output_dir(ns, recipe)
    catalog = _catalog(ns)
    spec = recipe.distributed
    if spec is not None and spec.num_processes * spec.num_machines > 1:
        from trl_ext.launch import already_launched, relaunch

        if not already_launched():
            preflight(recipe, catalog, output_dir, max_steps=ns.max_steps)  # report recipe errors once, here
            return relaunch(spec, ns.argv, machine_rank=ns.machine_rank)
    from trl_ext.launch import init_cpu_deepspeed
    from trl_ext.runner import with_backend_args

    init_cpu_deepspeed([stage.args for stage in with_backend_args(recipe).stages])
    try:
        run_recipe(recipe, output_dir, catalog, max_steps=ns.max_steps, restart_unfinished=ns.restart_unfinished)
    except Exception as exc:
        full = no_space_left(output_dir, exc)
        if full is None or isinstance(exc, TrlExtError):
            raise
        raise full from exc
    finally:
        _close_process_group()
    return 0


# Below this much free space a failed write is taken for a full disk: a failed write of a large file (an optimizer
# state, a model shard) can leave up to that file's size free.
NEARLY_FULL_BYTES = 64 * 2**20


def no_space_left(output_dir: str, exc: BaseException) -> OSError | None:
    """A run that failed on a full output file system, as one line that says so; None for any other failure.

    Libraries report a full disk in their own words (``torch.save``: "enforce fail at inline_container.cc ... unexpected
    pos"), so the failure is matched by errno ENOSPC anywhere in the exception chain, or by the output directory's file
    system being nearly full. Checkpoints count only once complete, so freeing space and rerunning resumes."""
    import errno
    import shutil

    chain, seen = [], exc
    while seen is not None and len(chain) < 20:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    existing = Path(output_dir).expanduser().absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        free = None
    enospc = any(isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left on device" in str(e)
                 for e in chain)
    if not enospc and (free is None or free >= NEARLY_FULL_BYTES):
        return None
    left = f" ({free} bytes free)" if free is not None else ""
    return OSError(errno.ENOSPC, f"output_dir {str(output_dir)!r}: no space left on its file system{left}; free "
                                 "space and rerun the same command to resume from the newest complete checkpoint")


def _close_process_group() -> None:
    """Tear down torch.distributed before interpreter exit: gloo's threads otherwise sometimes abort the process at
    shutdown ("terminate called without an active exception") after all work is done."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def cmd_plugins_list(ns) -> int:
    from trl_ext.catalog import Catalog

    catalog = Catalog.discover(block=set(ns.disabled_plugins))  # failures are rows of the listing itself
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
    info = _catalog(ns).resolve(ns.name)
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _disabled_plugin(text: str) -> str:
    if not text.startswith("no:") or not text[3:]:
        raise argparse.ArgumentTypeError(f"expected no:NAME (an entry point or distribution to skip), got {text!r}")
    return text[3:]


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage block before a usage error; the CLI's contract is one line per problem."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    # --debug and -p work before or after the subcommand (SUPPRESS keeps a subparser from resetting the other's value).
    common = _OneLineParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="print the traceback of any error")
    common.add_argument("-p", dest="disabled_plugins", action="append", type=_disabled_plugin, metavar="no:NAME",
                        default=argparse.SUPPRESS, help="do not load this plugin entry point or distribution")
    parser = _OneLineParser(prog="trl-ext", parents=[common],
                                     description="Post-training recipes on TRL trainers, with plugins.",
                                     epilog="exit codes: 0 ok, 2 usage or validation error, 1 runtime failure")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a recipe", parents=[common])
    train.add_argument("recipe")
    train.add_argument("--output-dir", help="where stages, metrics and run.json go (default: recipe's or runs/NAME)")
    train.add_argument("--max-steps", type=_positive_int, help="cap every stage at N optimizer steps (smoke runs)")
    train.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                       help="override a recipe field, e.g. stages.sft.args.learning_rate=1e-4 (repeatable)")
    train.add_argument("--trl", metavar="COMMAND", help="RECIPE is a TRL config file for `trl COMMAND --config` "
                                                        "(sft, grpo, rloo, dpo, kto, reward)")
    train.add_argument("--machine-rank", type=int, help="this machine's rank in a multi-machine `distributed:` run")
    train.add_argument("--restart-unfinished", action="store_true",
                       help="delete unfinished stages of a different recipe in the output directory and start over")
    train.set_defaults(func=cmd_train)

    validate = sub.add_parser("validate", help="check a recipe (and output directory) without loading any model",
                              parents=[common])
    validate.add_argument("recipe")
    validate.add_argument("--output-dir", help="check this output directory instead of the recipe's")
    validate.add_argument("--max-steps", type=_positive_int, help="validate with this step cap, as train would")
    validate.add_argument("--set", action="append", default=[], metavar="PATH=VALUE")
    validate.add_argument("--trl", metavar="COMMAND", help="RECIPE is a TRL config file (see train --trl)")
    validate.set_defaults(func=cmd_validate)

    convert = sub.add_parser("convert", help="print the recipe equivalent to a TRL config file")
    convert.add_argument("command_name", metavar="COMMAND", help="the TRL command: sft, grpo, rloo, dpo, kto, reward")
    convert.add_argument("config", help="the file `trl COMMAND --config FILE` would take")
    convert.set_defaults(func=cmd_convert)

    plugins = sub.add_parser("plugins", help="list or describe installed plugins", parents=[common])
    psub = plugins.add_subparsers(dest="plugins_command", required=True)
    plist = psub.add_parser("list", help="installed plugins with version, distribution, family, hooks, status",
                            parents=[common])
    plist.add_argument("--json", action="store_true")
    plist.set_defaults(func=cmd_plugins_list)
    pshow = psub.add_parser("show", help="a plugin's description, parameters and needs", parents=[common])
    pshow.add_argument("name")
    pshow.set_defaults(func=cmd_plugins_show)

    for kind in ("models", "datasets"):
        listing = sub.add_parser(kind, help=f"built-in {kind} (use as `embedded:<name>` in recipes)", parents=[common])
        listing.add_argument("--json", action="store_true")
        listing.set_defaults(func=cmd_named_list, kind=kind)
    return parser


def cmd_named_list(ns) -> int:
    """``trl-ext models`` / ``trl-ext datasets``: the names recipes can use as ``embedded:<name>``, with their source."""
    table = getattr(_catalog(ns), ns.kind)
    rows = [{"name": name, "use_as": f"embedded:{name}", "registered_by": source}
            for name, (_build, source) in sorted(table.items())]
    if ns.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<28}{'use as':<38}registered by")
    for row in rows:
        print(f"{row['name']:<28}{row['use_as']:<38}{row['registered_by']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command: user errors print one line per problem and return 2, runtime failures one line and 1."""
    ns = build_parser().parse_args(argv)  # usage errors: one line (_OneLineParser), exit 2
    ns.argv = list(sys.argv[1:] if argv is None else argv)  # re-used verbatim when `distributed:` re-launches
    ns.debug = getattr(ns, "debug", False)
    ns.disabled_plugins = getattr(ns, "disabled_plugins", None) or []
    if not ns.debug:
        # Libraries' deprecation notices (e.g. transformers on TRL's own `gradient_checkpointing` default) say nothing
        # the user can act on and repeat on every command; --debug shows them.
        import warnings

        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
    try:
        return ns.func(ns)
    except RecipeError as exc:
        _debug_traceback(ns)
        for message in exc.messages:  # one self-contained line per problem
            print(f"error: invalid recipe: {message}", file=sys.stderr)
        return EXIT_USAGE
    except TrlExtError as exc:
        _debug_traceback(ns)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception as exc:  # a runtime failure: one line, the traceback only on request
        _debug_traceback(ns)
        text = str(exc).strip()
        print(f"error: {type(exc).__name__}: {text.splitlines()[0] if text else ''}"
              f"{'' if ns.debug else '  (--debug shows the traceback)'}", file=sys.stderr)
        return EXIT_RUNTIME


def _debug_traceback(ns) -> None:
    if ns.debug:
        traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())
