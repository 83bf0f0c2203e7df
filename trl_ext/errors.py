"""Errors trl-ext raises for bad input. Each names the field, plugin or file at fault."""

from __future__ import annotations


class TrlExtError(Exception):
    """Base class: the CLI prints these without a traceback and exits non-zero."""


class RecipeError(TrlExtError):
    """A recipe is invalid. ``messages`` holds one line per problem, each starting with the field path."""

    def __init__(self, messages: list[str] | str):
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


class PluginConflictError(TrlExtError):
    """Two plugins claim one name or one exclusive slot."""


class UnknownPluginError(RecipeError):
    """A recipe names a plugin that is not installed (message includes suggestions and the available names)."""


class OutputDirError(TrlExtError):
    """The output directory holds another recipe's finished stages."""
