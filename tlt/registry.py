"""A named registry for the places users extend tlt (advantage estimators, policy losses)."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, config_key: str, decorator: str):
        self.kind, self.config_key, self.decorator = kind, config_key, decorator
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def wrap(fn: T) -> T:
            self._items[name] = fn
            return fn
        return wrap

    def get(self, name: str) -> T:
        if name not in self._items:
            raise KeyError(f"unknown {self.kind} '{name}'; registered: {', '.join(sorted(self._items))} "
                           f"(set {self.config_key}, or register one with @{self.decorator})")
        return self._items[name]
