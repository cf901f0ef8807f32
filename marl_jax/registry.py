"""One registry mechanism for every name -> thing table of the project.

Estimators, environments and their workflows, trace replayers and model presets are each a
`Registry`: a config names an entry, the registry returns it or fails with one line that lists
the names it knows. An entry is either the object itself or a lazy "package.module:attribute"
string, imported on first use, so a registry at a low layer can name code that lives higher up
(or is costly to import) without importing it.

This module is the bottom layer: it imports nothing from marl_jax.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
  """Names -> entries of one kind (`what` names the kind in error messages)."""

  def __init__(self, what: str):
    self.what = what
    self._entries: dict[str, T | str] = {}

  def register(self, name: str, entry: T | str, *, replace: bool = False) -> T | str:
    """Adds `entry` under `name`; a second, different entry for a name needs `replace=True`."""
    if not isinstance(name, str) or not name:
      raise ValueError(f"a {self.what} name must be a non-empty string, got {name!r}")
    if name in self._entries and self._entries[name] is not entry and not replace:
      raise ValueError(f"{self.what} {name!r} is already registered; pass replace=True to "
                       "replace it")
    self._entries[name] = entry
    return entry

  def get(self, name: str) -> T:
    if name not in self._entries:
      raise ValueError(f"unknown {self.what} {name!r}; expected one of {list(self.names())}")
    entry = self._entries[name]
    if isinstance(entry, str) and ":" in entry:
      module, attribute = entry.split(":", 1)
      entry = getattr(importlib.import_module(module), attribute)
      self._entries[name] = entry
    return entry  # type: ignore[return-value]

  def names(self) -> tuple[str, ...]:
    return tuple(sorted(self._entries))

  def having(self, attribute: str) -> list[str]:
    """The names whose entry has `attribute` set (truthy): for error messages that list the
    entries a setting applies to. Imports every lazy entry."""
    return [name for name in self.names() if getattr(self.get(name), attribute)]

  def __contains__(self, name: object) -> bool:
    return name in self._entries

  def __iter__(self) -> Iterator[str]:
    return iter(self.names())

  def __len__(self) -> int:
    return len(self._entries)
