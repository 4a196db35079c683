"""One small registry class: names -> objects, built-ins plus Python entry points."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any


class PluginLoadError(ImportError):
    """A plugin registered through an entry point failed to import."""


class Registry:
    """Maps names to objects (or lazy ``"module:attr"`` strings) and loads entry points once.

    `kind` names what is registered ("quantization method", "model architecture") in errors.
    With `case_insensitive`, lookups ignore case (quantization method names in HF configs vary).
    """

    def __init__(self, kind: str, entry_point_group: str, *, case_insensitive: bool = False):
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.case_insensitive = case_insensitive
        self._items: dict[str, Any] = {}
        self._plugins_loaded = False

    def _key(self, name: str) -> str:
        return name.lower() if self.case_insensitive else name

    def register(self, name: str, obj: Any, *, override: bool = False) -> None:
        key = self._key(name)
        existing = self._items.get(key)
        if existing is not None and existing is not obj and not override:
            raise ValueError(f"{self.kind} {name!r} is already registered ({existing!r})")
        self._items[key] = obj

    def decorator(self, name: str, *, override: bool = False) -> Callable[[Any], Any]:
        def wrap(obj: Any) -> Any:
            self.register(name, obj, override=override)
            return obj

        return wrap

    def load_plugins(self) -> None:
        """Import every entry point of the group once per process; errors name the plugin."""
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in entry_points(group=self.entry_point_group):
            try:
                obj = ep.load()
            except Exception as e:
                raise PluginLoadError(
                    f"plugin {ep.name!r} ({ep.value}) from entry point group "
                    f"{self.entry_point_group!r} failed to import: {type(e).__name__}: {e}"
                ) from e
            self.register(ep.name, obj, override=True)

    def names(self) -> list[str]:
        self.load_plugins()
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        self.load_plugins()
        return self._key(name) in self._items

    def get(self, name: str) -> Any:
        self.load_plugins()
        key = self._key(name)
        if key not in self._items:
            raise KeyError(
                f"unknown {self.kind} {name!r}; registered: {', '.join(self.names()) or '(none)'}"
            )
        obj = self._items[key]
        if isinstance(obj, str):
            module_name, _, attr = obj.partition(":")
            obj = getattr(importlib.import_module(module_name), attr)
            self._items[key] = obj
        return obj
