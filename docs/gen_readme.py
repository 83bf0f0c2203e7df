"""Regenerate the README's plugin table from the installed catalog: python docs/gen_readme.py"""

from pathlib import Path

README = Path(__file__).parent.parent / "README.md"
START, END = "## Plugins available\n", "\nConventions that change numbers"


def render_table() -> str:
    from trl_ext.catalog import Catalog

    rows = ["| plugin | family | trainers | what it is |", "|---|---|---|---|"]
    first_party = [info for info in Catalog.discover().plugins.values() if info.distribution == "trl-ext"]
    for info in sorted(first_party, key=lambda i: (i.cls.family, i.name)):
        text = info.cls.description()
        text = text if len(text) <= 110 else text[:107] + "..."
        trainers = ", ".join(sorted(info.cls.trainers)) or "any"
        rows.append(f"| `{info.name}` | {info.cls.family} | {trainers} | {text.replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n"


def render(readme: str) -> str:
    head, rest = readme.split(START, 1)
    _old, tail = rest.split(END, 1)
    return f"{head}{START}\n{render_table()}{END}{tail}"


if __name__ == "__main__":
    README.write_text(render(README.read_text()))
