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


# pydantic words a validator's own message as "Value error, <message>"; the message already says what is wrong.
_PYDANTIC_PREFIXES = {"value_error": "Value error, ", "assertion_error": "Assertion failed, "}


def validation_message(error: dict) -> str:
    """The text of one pydantic error (an item of ``ValidationError.errors()``), without pydantic's prefix on
    messages that a validator raised itself."""
    return error["msg"].removeprefix(_PYDANTIC_PREFIXES.get(error["type"], ""))
