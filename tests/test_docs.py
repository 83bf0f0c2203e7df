"""docs/hooks.md is generated from the hook docstrings and must match them."""

import importlib.util
from pathlib import Path

DOCS = Path(__file__).parent.parent / "docs"


def test_hook_reference_is_current():
    spec = importlib.util.spec_from_file_location("gen_hooks", DOCS / "gen_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (DOCS / "hooks.md").read_text() == module.render(), "run: python docs/gen_hooks.py"


def test_readme_plugin_table_lists_every_first_party_plugin():
    spec = importlib.util.spec_from_file_location("gen_readme", DOCS / "gen_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (DOCS.parent / "README.md").read_text()
    assert readme == module.render(readme), "run: python docs/gen_readme.py"
