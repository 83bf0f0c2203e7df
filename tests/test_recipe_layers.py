"""The core reads as layers: data at the bottom (hook spec, recipe schema), then the plugin host and catalog, then
stages and trainers, then the runner, then the command line. No module imports one from a higher layer, and no import
cycle exists anywhere in ``trl_ext`` (imports inside functions and under ``TYPE_CHECKING`` count: they are still a
dependency of the code). Parsed with ``ast``; nothing is imported."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "trl_ext"

# Layer of each core module (prefix match: "trl_ext.trainers" covers every trainer module). Modules not listed here
# (new leaf helpers) are still covered by the no-cycle check.
LAYERS = {
    # 0: leaves with no core dependency
    "trl_ext.errors": 0, "trl_ext.faults": 0, "trl_ext.files": 0, "trl_ext.plugin": 0, "trl_ext.batches": 0, "trl_ext.ops": 0,
    "trl_ext.embedded": 0, "trl_ext.evaluation": 0, "trl_ext.plotting": 0,
    # 1: the data the rest agrees on
    "trl_ext": 1, "trl_ext.hookspecs": 1, "trl_ext.recipe": 1,
    # 2: plugins as installed (catalog) and as selected (host), and what the runner attaches to a trainer
    "trl_ext.host": 2, "trl_ext.catalog": 2, "trl_ext.builtins": 2, "trl_ext.callbacks": 2, "trl_ext.rewards": 2,
    # 3: one stage, and the trainers that run it
    "trl_ext.stage": 3, "trl_ext.trainers": 3,
    # 4-5: running recipes, and the command line / pytest plugin on top
    "trl_ext.runner": 4, "trl_ext.cli": 5, "trl_ext.testing": 5,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in modules:
                found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
    return found


def _layer(module: str) -> int | None:
    best = max((prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")), key=len,
               default=None)
    return LAYERS[best] if best is not None else None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}


def test_no_module_imports_a_higher_layer():
    upward = []
    for module, deps in _graph().items():
        for dep in deps:
            if dep.startswith(module + "."):
                continue  # a package importing its own submodules (trainers/__init__ -> trainers.grpo)
            low, high = _layer(module), _layer(dep)
            if low is not None and high is not None and high > low:
                upward.append(f"{module} (layer {low}) imports {dep} (layer {high})")
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = _graph()
    # A package's __init__ importing its submodules is not a cycle with them importing a sibling.
    edges = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, trail):
        state[node] = 1
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(trail[trail.index(dep):] + [dep]) if dep in trail else f"{node} -> {dep}")
            elif dep not in state:
                visit(dep, trail + [dep])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_the_layering_check_sees_an_upward_import(tmp_path):
    """The check is not vacuous: the old recipe -> stage import (inside a function) is found."""
    source = tmp_path / "recipe.py"
    source.write_text("def validate():\n    from trl_ext.stage import resolve_stage\n")
    deps = _imports(source, set(_modules()))
    assert deps == {"trl_ext.stage"} and _layer("trl_ext.stage") > _layer("trl_ext.recipe")


def test_trainer_specific_checks_live_with_the_trainer_kinds():
    """stage.py holds no `stage.trainer == "..."` comparison: each TrainerKind owns its checks."""
    tree = ast.parse((PACKAGE / "stage.py").read_text())
    compared = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Compare)
                and any(isinstance(c, ast.Constant) and isinstance(c.value, str) for c in node.comparators)
                and "trainer" in ast.unparse(node.left)]
    assert not compared, compared
