"""Discovery of installed plugins through the ``trl_ext`` entry-point group.

The catalog is what is *installed*; the per-stage :class:`trl_ext.host.PluginHost` is what a recipe *selects*.
First-party plugins are found exactly like third-party ones: ``pyproject.toml`` declares them in the same group.

Environment variables (comma-separated entry-point or distribution names):

* ``TRL_EXT_PLUGINS``: allow-list; when set, only these entry points are loaded (plus ``builtins``, the core's own
  models and datasets, which is always loaded);
* ``TRL_EXT_PLUGINS_BLOCK``: block-list; these entry points are never loaded (wins over the allow-list);
* ``TRL_EXT_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry point except ``builtins`` (tests and embedding use this and
  register what they need by hand).

The command line adds ``trl-ext -p no:NAME`` (repeatable, as pytest's ``-p no:``), which blocks one entry point or
distribution for that command. An entry point whose import or registration raises anything (``SystemExit`` and other
``BaseException``s included; only ``KeyboardInterrupt`` propagates) is recorded in :attr:`Catalog.failures`, naming
its distribution and entry point, with nothing it registered kept; the other plugins load normally.
"""

from __future__ import annotations

import difflib
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable

import pluggy
from pydantic import BaseModel

from trl_ext import hookspecs

# The catalog a stage is being validated against, for plugins that resolve other plugins by name inside their own
# checks (multi_env's and pass_rate_filter's reward selections): Catalog.discover() would miss plugins the caller
# registered itself (tests, an embedding program) and include ones `-p no:NAME` left out.
_VALIDATING: ContextVar[Catalog | None] = ContextVar("trl_ext_validating_catalog", default=None)


@contextmanager
def validating_with(catalog: Catalog) -> Iterator[None]:
    token = _VALIDATING.set(catalog)
    try:
        yield
    finally:
        _VALIDATING.reset(token)


def validating_catalog() -> Catalog | None:
    """The catalog of the stage validation in progress (:func:`validating_with`), else ``None``."""
    return _VALIDATING.get()
from trl_ext.errors import PluginConflictError, UnknownPluginError
from trl_ext.plugin import SLOT_OF_HOOK, Need, Plugin, Slot

ENTRY_POINT_GROUP = "trl_ext"
ENV_ALLOW = "TRL_EXT_PLUGINS"
ENV_BLOCK = "TRL_EXT_PLUGINS_BLOCK"
ENV_DISABLE_AUTOLOAD = "TRL_EXT_DISABLE_PLUGIN_AUTOLOAD"
ALWAYS_LOADED = "builtins"

SPEC_NAMES = frozenset(n for n in dir(hookspecs) if n.startswith("trl_ext_"))
REGISTRATION_HOOKS = frozenset({"trl_ext_register_plugins", "trl_ext_register_models", "trl_ext_register_datasets"})


@dataclass
class PluginInfo:
    """One selectable plugin and where it came from."""

    cls: type[Plugin]
    source: str  # entry-point name, or "<manual>"
    distribution: str
    version: str

    @property
    def name(self) -> str:
        return self.cls.name


@dataclass
class LoadFailure:
    """An entry point that could not be loaded; reported, never fatal for recipes that do not need it."""

    source: str
    distribution: str
    error: str


@dataclass
class Catalog:
    """Installed plugins, models and datasets, with name resolution and did-you-mean errors."""

    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    models: dict[str, tuple[Callable[..., Any], str]] = field(default_factory=dict)
    datasets: dict[str, tuple[Callable[..., Any], str]] = field(default_factory=dict)
    failures: list[LoadFailure] = field(default_factory=list)

    # -- discovery ---------------------------------------------------------------------------------------------

    @classmethod
    def discover(cls, autoload: bool | None = None, block: set[str] | frozenset[str] = frozenset()) -> "Catalog":
        """Load every allowed entry point of the ``trl_ext`` group and let each register what it provides.

        ``block``: entry-point or distribution names not to load, on top of ``TRL_EXT_PLUGINS_BLOCK``."""
        catalog = cls()
        if autoload is None:
            autoload = os.environ.get(ENV_DISABLE_AUTOLOAD, "") not in ("1", "true", "yes")
        allow = _env_names(ENV_ALLOW)
        block = (_env_names(ENV_BLOCK) or set()) | set(block)
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name != ALWAYS_LOADED):
            dist_name = ep.dist.name if ep.dist is not None else "?"
            if ep.name != ALWAYS_LOADED:
                if not autoload or ep.name in block or dist_name in block:
                    continue
                if allow is not None and ep.name not in allow and dist_name not in allow:
                    continue
            catalog.load_entry_point(ep)
        return catalog

    def load_entry_point(self, ep: metadata.EntryPoint) -> None:
        dist = ep.dist
        dist_name = dist.name if dist is not None else "?"
        version = dist.version if dist is not None else "?"
        # A broken plugin must not break runs that do not select it: whatever its import or its registration hooks
        # raise (sys.exit() included) is recorded, and what it registered before failing is dropped.
        try:
            obj = ep.load()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self.failures.append(LoadFailure(ep.name, dist_name, _short_error(exc)))
            return
        snapshot = (dict(self.plugins), dict(self.aliases), dict(self.models), dict(self.datasets))
        try:
            self.add_source(obj, source=ep.name, distribution=dist_name, version=version)
        except PluginConflictError:
            raise  # a name clash is the installer's problem to fix, named on both sides; never silently resolved
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self.plugins, self.aliases, self.models, self.datasets = snapshot
            self.failures.append(LoadFailure(ep.name, dist_name, _short_error(exc)))

    def add_source(self, obj: Any, source: str = "<manual>", distribution: str = "<manual>", version: str = "0") -> None:
        """Register what one entry-point object provides: a Plugin subclass, or a module/class with registration hooks."""
        if isinstance(obj, type) and issubclass(obj, Plugin):
            self.add_plugin(obj, source, distribution, version)
            return
        unknown = [n for n in dir(obj) if n.startswith("trl_ext_") and n not in SPEC_NAMES]
        if unknown:
            raise TypeError(f"{source}: hook implementation(s) with no matching spec: {', '.join(sorted(unknown))}")
        run_hooks = [n for n in dir(obj) if n in SPEC_NAMES and n not in REGISTRATION_HOOKS]
        if run_hooks:
            raise TypeError(
                f"{source}: run hooks ({', '.join(run_hooks)}) belong on a Plugin subclass, not on an entry-point module"
            )
        if not any(n in REGISTRATION_HOOKS for n in dir(obj)):
            # Listed nowhere and silently unused otherwise: a typo'd entry point (module:Clas) or an ordinary class.
            raise TypeError(f"{source}: {obj!r} is neither a trl_ext.Plugin subclass nor a module with registration "
                            f"hooks ({', '.join(sorted(REGISTRATION_HOOKS))})")
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        pm.register(obj, name=source)
        pm.check_pending()
        pm.hook.trl_ext_register_plugins(register=lambda c: self.add_plugin(c, source, distribution, version))
        pm.hook.trl_ext_register_models(register=lambda n, f: self._add_named(self.models, "model", n, f, source))
        pm.hook.trl_ext_register_datasets(register=lambda n, f: self._add_named(self.datasets, "dataset", n, f, source))

    def add_plugin(self, plugin_cls: type[Plugin], source: str = "<manual>", distribution: str = "<manual>", version: str = "0") -> None:
        check_plugin_class(plugin_cls)
        info = PluginInfo(plugin_cls, source, distribution, version)
        for key in (plugin_cls.name, *plugin_cls.aliases):
            holder = self.plugins.get(key) or self.plugins.get(self.aliases.get(key, ""))
            if holder is not None and holder.cls is not plugin_cls:
                raise PluginConflictError(
                    f"plugin name {key!r} is claimed twice: by {holder.cls.__module__}.{holder.cls.__qualname__} "
                    f"(distribution {holder.distribution}) and by {plugin_cls.__module__}.{plugin_cls.__qualname__} "
                    f"(distribution {distribution})"
                )
        self.plugins[plugin_cls.name] = info
        for alias in plugin_cls.aliases:
            self.aliases[alias] = plugin_cls.name

    def remove_plugin(self, name: str) -> None:
        """Unregister a plugin (used by tests in ``finally`` blocks, never on the live catalog of a run)."""
        info = self.plugins.pop(name)
        for alias in info.cls.aliases:
            self.aliases.pop(alias, None)

    @staticmethod
    def _add_named(table: dict, kind: str, name: str, fn: Callable[..., Any], source: str) -> None:
        if name in table and table[name][0] is not fn:
            raise PluginConflictError(f"{kind} name {name!r} is registered by both {table[name][1]} and {source}")
        table[name] = (fn, source)

    # -- lookup ------------------------------------------------------------------------------------------------

    def resolve(self, name: str, where: str = "plugins") -> PluginInfo:
        """Find a plugin by name or alias, or raise with suggestions and the available names."""
        canonical = self.aliases.get(name, name)
        if canonical in self.plugins:
            return self.plugins[canonical]
        failed = [f for f in self.failures if f.source == name]
        if failed:
            raise UnknownPluginError(f"{where}: plugin {name!r} is installed but failed to load: {failed[0].error}")
        known = sorted([*self.plugins, *self.aliases])
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        raise UnknownPluginError(f"{where}: unknown plugin {name!r}.{hint} Available: {', '.join(sorted(self.plugins))}")

    def failure_for_unknown(self) -> list[LoadFailure]:
        return list(self.failures)


def check_plugin_class(plugin_cls: type[Plugin]) -> None:
    """Conformance rules every plugin class must meet (raised at registration, i.e. load time)."""
    if not (isinstance(plugin_cls, type) and issubclass(plugin_cls, Plugin)):
        raise TypeError(f"{plugin_cls!r} is not a subclass of trl_ext.Plugin")
    where = f"{plugin_cls.__module__}.{plugin_cls.__qualname__}"
    name = getattr(plugin_cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{where}: a Plugin subclass must set a non-empty class attribute `name`")
    _check_declarations(plugin_cls, name)
    hooks = plugin_cls.implemented_hooks()
    unknown = [h for h in hooks if h not in SPEC_NAMES]
    if unknown:
        raise TypeError(f"plugin {name!r} ({where}): hook implementation(s) with no matching spec: {', '.join(unknown)}")
    registration = [h for h in hooks if h in REGISTRATION_HOOKS]
    if registration:
        raise TypeError(f"plugin {name!r}: registration hooks ({', '.join(registration)}) belong on the entry-point module")
    for hook in hooks:
        slot = SLOT_OF_HOOK.get(hook)
        if slot is not None and slot not in plugin_cls.slots:
            raise TypeError(f"plugin {name!r} implements {hook} and must declare the exclusive slot {slot.value!r}")
        if getattr(getattr(plugin_cls, hook), "trl_ext_impl", None) is None:
            raise TypeError(f"plugin {name!r}: method {hook} must be decorated with @trl_ext.hookimpl")
    # pluggy checks a hook's argument names only when a stage's host registers the plugin, long after loading.
    probe = pluggy.PluginManager(hookspecs.PROJECT)
    probe.add_hookspecs(hookspecs)
    try:
        probe.register(plugin_cls, name=name)
    except pluggy.PluginValidationError as exc:
        raise TypeError(f"plugin {name!r}: {' '.join(str(exc).split())}") from None


def _check_declarations(plugin_cls: type[Plugin], name: str) -> None:
    """The class attributes validation reads: a parameter schema that refuses unknown keys, and collections (never a
    bare string, whose letters would be read as the items) of trainer names, aliases, slots and needs."""
    params = plugin_cls.Params
    if not (isinstance(params, type) and issubclass(params, BaseModel)):
        raise TypeError(f"plugin {name!r}: Params must be a trl_ext.PluginParams subclass, got {params!r}")
    if params.model_config.get("extra") != "forbid":
        raise TypeError(f"plugin {name!r}: its Params class must refuse unknown keys (derive it from "
                        "trl_ext.PluginParams, or set extra='forbid'), else a misspelt parameter is ignored")
    expected = {"trainers": str, "aliases": str, "slots": Slot, "needs": Need, "provides": Need}
    for attribute, item_type in expected.items():
        value = getattr(plugin_cls, attribute)
        if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list, set, frozenset)):
            raise TypeError(f"plugin {name!r}: {attribute} must be a collection of {item_type.__name__}, got {value!r}")
        wrong = [item for item in value if not isinstance(item, item_type) or item == ""]
        if wrong:
            raise TypeError(f"plugin {name!r}: {attribute} holds {wrong[0]!r}, not a {item_type.__name__}")


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _short_error(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"
