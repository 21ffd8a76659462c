"""Named scorers of one kind (eviction policies, per-token signals), registered by decorator and made by name.

A `Registry` belongs to the package whose modules define its entries (``evictor.policies``, ``signals``): the first
time it is read, it imports every public module of that package (pkgutil, in name order), so a module registers its
entries by existing and no list of them is kept by hand. The package's own modules read it from functions, never
while they are being imported: the registry may be importing them at that moment.

Listing order is stable whatever was imported first: by `order` (when the registry has one), then by defining module
(the package's in name order, any other module after them), then in definition order within a module.
"""

from __future__ import annotations

import importlib
import itertools
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from core.errors import unknown_choice


class _Named(Protocol):
    """What a registered class has: the ``name`` attribute `Registry.register` sets."""

    name: ClassVar[str]


T = TypeVar("T", bound=_Named)


class Registry(Mapping[str, type[T]], Generic[T]):
    """Name -> registered class, for the classes of one `kind` defined in `package` (and any registered elsewhere);
    `order` maps a class to the leading key of its place in the listing."""

    def __init__(self, kind: str, package: str, order: Callable[[type[T]], Any] | None = None):
        self.kind = kind
        self.package = package
        self.order = order
        self._entries: dict[str, tuple[type[T], int]] = {}  # name -> (class, registration number)
        self._count = itertools.count()
        self._modules: dict[str, int] | None = None  # the package's modules in name order, once discovered

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: register the class under `name` (also its ``name`` attribute); a name is taken once."""

        def decorate(cls: type[T]) -> type[T]:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            cls.name = name
            self._entries[name] = (cls, next(self._count))
            return cls

        return decorate

    def unregister(self, name: str) -> None:
        """Forget `name` (a plug-in or a test that registered it and is done with it)."""
        self._discover()
        if name not in self._entries:
            raise unknown_choice(self.kind, name, self.names())
        del self._entries[name]

    def create(self, name: str, **params: Any) -> T:
        """An instance of the class registered as `name`; an unknown name is a `UsageError` naming the nearest."""
        self._discover()
        if name not in self._entries:
            raise unknown_choice(self.kind, name, self.names())
        return self._entries[name][0](**params)

    def names(self) -> list[str]:
        """Every registered name, in listing order."""
        self._discover()
        modules = self._modules or {}

        def place(name: str) -> tuple:
            cls, number = self._entries[name]
            lead = () if self.order is None else (self.order(cls),)
            return (*lead, modules.get(cls.__module__, len(modules)), number)

        return sorted(self._entries, key=place)

    def __getitem__(self, name: str) -> type[T]:
        self._discover()
        return self._entries[name][0]

    def __contains__(self, name: object) -> bool:
        self._discover()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._discover()
        return len(self._entries)

    def _discover(self) -> None:
        if self._modules is not None:
            return
        package = importlib.import_module(self.package)
        found = sorted(info.name for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_"))
        self._modules = {f"{self.package}.{name}": index for index, name in enumerate(found)}
        try:
            for module in self._modules:
                importlib.import_module(module)
        except BaseException:
            self._modules = None  # a failed import is retried (and raised again) at the next read
            raise
