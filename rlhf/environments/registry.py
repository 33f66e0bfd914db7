"""Environments by name: what ``environment.name`` in the experiment config and ``Reset.environment`` refer to.

A spec is a registered name (``builtin:calculator``), ``python:<module>:<factory>`` or ``<prefix>:<rest>`` for a
prefix registered with :func:`register_prefix`; a factory is called once per episode as ``factory(**options)``.
API: :func:`register`, :func:`register_prefix`, :func:`resolve` (``UnknownEnvironment`` when there is none),
:func:`check` (never imports a ``python:`` module), :func:`make`, :func:`names`; lookups first import
:data:`PLUGIN_MODULES`.

Design: docs/environments.md#bringing-your-own-environment.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

from rlhf.environments.base import Environment

Factory = Callable[..., Environment]
Resolver = Callable[[str], Factory]

# Modules that register environments when imported (adapters add theirs here).
PLUGIN_MODULES: list[str] = ["rlhf.environments.builtin", "rlhf.environments.adapters"]

_FACTORIES: dict[str, Factory] = {}
_PREFIXES: dict[str, Resolver] = {}
_BROKEN: dict[str, str] = {}  # plugin module -> why it failed to import
_lock = threading.Lock()
_plugins_lock = threading.RLock()
_loaded = False
log = logging.getLogger("rlhf.environments")


class UnknownEnvironment(ValueError):
    """A spec that names no environment (or a factory that cannot be found); the message lists what exists."""


def register(name: str, factory: Factory) -> None:
    """Make ``name`` (e.g. ``builtin:calculator``) build environments with ``factory(**options)``."""
    if not name or not callable(factory):
        raise TypeError("register(name, factory): a non-empty name and a callable factory")
    if name.startswith("python:"):
        raise ValueError("python: is reserved for python:<module>:<factory> specs")
    with _lock:
        if name in _FACTORIES and _FACTORIES[name] is not factory:
            raise ValueError(f"environment {name!r} is already registered")
        _FACTORIES[name] = factory


def register_prefix(prefix: str, resolver: Resolver) -> None:
    """Make ``<prefix>:<rest>`` resolve to ``resolver(rest)`` (a factory; raise UnknownEnvironment when ``rest``
    names nothing). Registered names win over prefixes."""
    prefix = prefix.rstrip(":")
    if not prefix or prefix == "python" or ":" in prefix:
        raise ValueError(f"bad environment prefix {prefix!r}")
    with _lock:
        if prefix in _PREFIXES and _PREFIXES[prefix] is not resolver:
            raise ValueError(f"environment prefix {prefix!r} is already registered")
        _PREFIXES[prefix] = resolver


def _load_plugins() -> None:
    global _loaded
    if _loaded:
        return
    with _plugins_lock:  # reentrant: a plugin that looks names up while it loads sees what is registered so far
        if _loaded:
            return
        _loaded = True
        for mod in PLUGIN_MODULES:
            try:
                importlib.import_module(mod)
            except Exception as err:  # noqa: BLE001 - one broken plugin must not break every config load
                # its names are then unknown, and the unknown-name error says why
                _BROKEN[mod] = f"{type(err).__name__}: {err}"
                log.warning("environment plugin %s failed to import (%s)", mod, _BROKEN[mod])


def names() -> list[str]:
    _load_plugins()
    return sorted(_FACTORIES)


def _known() -> str:
    prefixes = [f"{p}:<...>" for p in sorted(_PREFIXES)]
    known = ", ".join([*names(), "python:<module>:<factory>", *prefixes])
    broken = "".join(f" ({mod} failed to import: {why})" for mod, why in _BROKEN.items())
    return known + broken


def _split_python(spec: str) -> tuple[str, str]:
    parts = spec.split(":")
    if len(parts) != 3 or not all(p.strip() for p in parts[1:]):
        raise UnknownEnvironment(f"{spec!r}: write python:<module>:<factory>, e.g. python:my_envs.maze:Maze")
    return parts[1].strip(), parts[2].strip()


def _import_factory(spec: str) -> Factory:
    module_name, attr = _split_python(spec)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UnknownEnvironment(f"{spec!r}: cannot import {module_name} ({err})") from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise UnknownEnvironment(f"{spec!r}: {module_name} has no {attr}")
    if not callable(factory):
        raise UnknownEnvironment(f"{spec!r}: {module_name}.{attr} is not callable")
    return factory


def resolve(spec: str) -> Factory:
    """The factory ``spec`` names (imports a ``python:`` module); UnknownEnvironment otherwise."""
    _load_plugins()
    if spec in _FACTORIES:
        return _FACTORIES[spec]
    if spec.startswith("python:"):
        return _import_factory(spec)
    prefix, sep, rest = spec.partition(":")
    if sep and prefix in _PREFIXES:
        return _PREFIXES[prefix](rest)
    raise UnknownEnvironment(f"unknown environment {spec!r}; known: {_known()}")


def check_options(spec: str, factory: Factory, options: dict[str, Any]) -> None:
    """UnknownEnvironment naming an option ``factory(**options)`` would refuse (by its signature)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return
    try:
        sig.bind(**options)
    except TypeError as err:
        params = [p for p in sig.parameters if p != "self"]
        raise UnknownEnvironment(
            f"options {sorted(options)} do not fit {spec!r} ({err}); it takes: {', '.join(params) or 'no options'}"
        ) from None


def check(spec: str, options: dict[str, Any] | None = None) -> None:
    """Validate a spec (and its options, when it resolves without importing user code) for a config."""
    _load_plugins()
    if spec.startswith("python:"):
        _split_python(spec)
        return
    check_options(spec, resolve(spec), dict(options or {}))


def make(spec: str, options: dict[str, Any] | None = None) -> Environment:
    """A new environment instance (one episode): ``resolve(spec)(**options)``."""
    env = resolve(spec)(**dict(options or {}))
    if not isinstance(env, Environment):
        raise TypeError(f"{spec!r} made a {type(env).__name__}, not an rlhf.environments.base.Environment")
    return env
