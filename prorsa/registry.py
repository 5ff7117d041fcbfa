"""String-keyed registries (forecasters, policies, profiles, scenarios).

One registry per kind; registering a name twice is an error so that plugins cannot
silently replace a built-in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from prorsa.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of factories or objects of one kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T | None = None) -> Callable[[T], T] | T:
        """Register ``item`` under ``name``; usable as a decorator when ``item`` is omitted."""

        def add(obj: T) -> T:
            if name in self._items:
                raise ConfigError(f"{self.kind} '{name}' is already registered")
            self._items[name] = obj
            return obj

        if item is None:
            return add
        return add(item)

    def get(self, name: str) -> T:
        """Return the item registered as ``name`` or raise a ConfigError listing the choices."""
        try:
            return self._items[name]
        except KeyError:
            choices = ", ".join(sorted(self._items)) or "(none)"
            raise ConfigError(
                f"unknown {self.kind} '{name}'", hint=f"choose one of: {choices}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)
