"""The architecture registry: config.json (`model_type`, else `architectures`) → `Architecture`.

Built-in architectures are named here by module path and imported on first use (as vLLM's
model registry does), so reading a config imports only the architecture it names, and the
architecture modules may import engine.config without an import circle. `register` adds one
at run time; `RINGSERVE_ARCHITECTURES` (comma-separated module names, imported at the first lookup
in every process, worker processes included) names plug-in modules that call `register` when
imported — a third-party or test-only architecture served without touching engine or server code.
No torch here.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from .base import Architecture

# name → "module:attribute" of a built-in Architecture instance
BUILTIN = {
    "v4": "engine.v4.architecture:ARCHITECTURE",
    "v41": "engine.v41.architecture:ARCHITECTURE",
}

PLUGINS_ENV = "RINGSERVE_ARCHITECTURES"

_loaded: dict[str, Architecture] = {}
_plugins_imported: set[str] = set()


class UnknownArchitecture(ValueError):
    """No registered architecture has this name or serves this config.json."""


def register(arch: Architecture) -> Architecture:
    """Add (or replace) an architecture; its name and model types must not collide with another's."""
    if not arch.name:
        raise ValueError("an architecture needs a name")
    for other in _all():
        if other.name != arch.name and set(other.model_types) & set(arch.model_types):
            raise ValueError(f"model_type {sorted(set(other.model_types) & set(arch.model_types))[0]!r} is "
                             f"already served by {other.name}")
    _loaded[arch.name] = arch
    return arch


def unregister(name: str) -> None:
    """Remove a run-time registration (a test's toy); built-ins come back on the next lookup."""
    _loaded.pop(name, None)


def _builtin(name: str) -> Architecture:
    module, attr = BUILTIN[name].split(":")
    return getattr(importlib.import_module(module), attr)


def _import_plugins() -> None:
    """Import every module RINGSERVE_ARCHITECTURES names (once each); they register themselves."""
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        if module not in _plugins_imported:
            _plugins_imported.add(module)
            importlib.import_module(module)


def _all() -> list[Architecture]:
    for name in BUILTIN:
        if name not in _loaded:
            _loaded[name] = _builtin(name)
    _import_plugins()
    return list(_loaded.values())


def names() -> list[str]:
    """Every registered architecture's name (built-ins first)."""
    return [a.name for a in _all()]


def get(name: str) -> Architecture:
    """The architecture called `name` (ModelConfig.arch)."""
    if name not in _loaded and name in BUILTIN:
        _loaded[name] = _builtin(name)
    if name not in _loaded:
        _all()  # a plug-in's
    if name not in _loaded:
        raise UnknownArchitecture(f"unknown architecture {name!r}; registered: {', '.join(names())}")
    return _loaded[name]


def of(cfg: Any) -> Architecture:
    """The architecture of a parsed model config (its `arch` field; V4 when it has none)."""
    return get(getattr(cfg, "arch", None) or "v4")


def having(capability: str) -> str:
    """The display names of the architectures with a capability (for messages), e.g. 'DeepSeek-V4.1'."""
    return ", ".join(a.display_name for a in _all() if getattr(a.capabilities, capability))


def served_model_types() -> list[str]:
    return [t for a in _all() for t in a.model_types]


def for_config(raw: dict[str, Any]) -> Architecture | None:
    """The architecture that serves a config.json: by `model_type`, else by `architectures`;
    None when none does (engine.config names the problem)."""
    model_type = raw.get("model_type")
    archs = _all()
    found = next((a for a in archs if model_type in a.model_types), None)
    if found is None and model_type is None:
        declared = raw.get("architectures") or []
        found = next((a for a in archs if set(declared) & set(a.hf_architectures)), None)
    return found
