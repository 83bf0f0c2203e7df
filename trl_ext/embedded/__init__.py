"""Embedded default model and task, built in code so nothing is downloaded.

- `trl_ext.embedded.tokenizer`: `build_tokenizer()`, the character-level tokenizer.
- `trl_ext.embedded.models`: `EMBEDDED_MODELS`, `build_model()`, `materialize_model()`.
- `trl_ext.embedded.arithmetic`: `EMBEDDED_DATASETS`, `arithmetic_dataset()`, `exact_match_reward()`.
- `trl_ext.embedded.splits`: `seeded_split()`, `first_problems()`, how every embedded task splits its problems.

The submodules are not imported here so that importing one of them does not load the others.
"""
