"""One registry type for every extension: name -> ``"module:attribute"``, resolved on first use.

Checks, fault kinds, expectations and their judges, job backends and queues are each one
:class:`Registry`: an ordered table of names, each bound to a registration line that names the
module and attribute of its implementation (or to the object itself, for one registered at run
time). Listing the names imports nothing, as entry points do, so a lower layer can name what a
higher one implements: the job-file schema accepts the registered names, the pytest markers and
the docs' tables are made from them. A line is imported when its entry is first asked for; one
that cannot be is said in words with the line and the fix, never as an ImportError traceback.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar, cast

from trainguard.errors import ConfigError

__all__ = ["NotInstalled", "Registry"]

T = TypeVar("T")


class NotInstalled(ConfigError):
    """A registration line names a module or attribute that cannot be imported, or something
    that is not what the registry holds."""


def _not_installed(what: str, error: type[Exception]) -> Callable[[str, str, Exception], Exception]:
    def missing(_name: str, line: str, exc: Exception) -> Exception:
        return error(f"the {what} registered as {line!r} cannot be imported: {exc}; install the "
                     "package that provides it or remove its registration line")

    return missing


class Registry(Generic[T]):
    """Names bound to lazy registration lines (``"module:attribute"``) or to objects, in order.

    ``what`` names an entry in messages ("check", "fault"); ``accepts(value)`` says whether a
    resolved line is an entry (``a`` says what it must be: "a trainguard Check"), ``name_of``
    the name an entry gives itself (checked against the name it is registered under).
    ``error`` is the class of the errors it raises (a :class:`NotInstalled` by default), and
    ``missing(name, line, exc)`` the error of a line that cannot be imported."""

    def __init__(
        self,
        what: str,
        lines: Mapping[str, str | T],
        *,
        accepts: Callable[[object], bool] | None = None,
        a: str = "",
        name_of: Callable[[T], str] | None = None,
        error: type[Exception] = NotInstalled,
        missing: Callable[[str, str, Exception], Exception] | None = None,
    ) -> None:
        self.what = what
        self._targets: dict[str, str | T] = dict(lines)
        self._resolved: dict[str, T] = {}
        self._accepts = accepts
        self._a = a or f"a {what}"
        self._name_of = name_of
        self._error = error
        self._missing = missing or _not_installed(what, error)
        self._hooks: list[Callable[[], None]] = []

    # -- the names: nothing is imported ---------------------------------------------------------

    def names(self) -> tuple[str, ...]:
        """The registered names, in order."""
        return tuple(self._targets)

    def __contains__(self, name: object) -> bool:
        return name in self._targets

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._targets))

    def __len__(self) -> int:
        return len(self._targets)

    def line(self, name: str) -> str:
        """Where ``name``'s entry is defined: its registration line (``"module:attribute"``)."""
        target = self._targets[name]
        if isinstance(target, str):
            return target
        return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', type(target).__qualname__)}"

    def lines(self) -> dict[str, str]:
        """name -> registration line, in order (the docs' tables are checked against it)."""
        return {name: self.line(name) for name in self._targets}

    # -- the entries: resolved on first use -----------------------------------------------------

    def get(self, name: str) -> T:
        """The entry registered as ``name``, its line imported on first use. KeyError naming the
        registered names for an unknown one; the registry's error for a line that cannot be
        imported or is not an entry."""
        if name in self._resolved:
            return self._resolved[name]
        try:
            target = self._targets[name]
        except KeyError:
            raise KeyError(f"no {self.what} is registered as {name!r}; registered: {', '.join(self._targets)}") from None
        value = self._resolve(name, target)
        self._resolved[name] = value
        return value

    def find(self, name: str) -> T | None:
        """The entry registered as ``name``, or None when none is."""
        return self.get(name) if name in self._targets else None

    def entries(self) -> tuple[T, ...]:
        """Every entry, in order (every line imported)."""
        return tuple(self.get(name) for name in self._targets)

    def load(self, line: str) -> T:
        """What ``line`` names, imported and checked to be an entry, without registering it."""
        return self._resolve(None, line)

    def _resolve(self, name: str | None, target: str | T) -> T:
        if not isinstance(target, str):
            return target
        module, _, attribute = target.partition(":")
        try:
            value = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as exc:
            raise self._missing(name or target, target, exc) from None
        if self._accepts is not None and not self._accepts(value):
            raise self._error(f"{target!r} is a {type(value).__name__}, not {self._a}")
        entry = cast(T, value)
        if name is not None and self._name_of is not None and self._name_of(entry) != name:
            raise self._error(f"{target!r} is the {self.what} {self._name_of(entry)!r}, registered as {name!r}: "
                              f"register it as {self._name_of(entry)!r}")
        return entry

    # -- changes at run time ---------------------------------------------------------------------

    def register(self, name: str, target: str | T, *, before: str | None = None, lazy: bool = False) -> None:
        """Add ``name`` (an extension outside trainguard, or a test's), bound to a line or an
        object; ``before`` names the entry it goes before (default: the end). The line is
        resolved now, so a wrong one fails here (``lazy``: on first use, as the built-in lines
        are). Registering the same target again changes nothing; another under a taken name is
        refused (unregister the old one first)."""
        if before is not None and before not in self._targets:
            raise self._error(f"register({name!r}, before={before!r}): no {self.what} is registered as "
                              f"{before!r}; registered: {', '.join(self._targets)}")
        value = None if lazy else self._resolve(name, target)
        if name in self._targets:
            if self._targets[name] == target:
                return
            raise self._error(f"{self.what} {name!r} is registered already (as {self.line(name)!r}); "
                              "unregister it first, or register yours under another name")
        names = list(self._targets)
        names.insert(len(names) if before is None else names.index(before), name)
        self._targets = {n: target if n == name else self._targets[n] for n in names}
        if value is not None:
            self._resolved[name] = value
        self._changed()

    def unregister(self, name: str) -> None:
        """Take ``name`` out again (nothing happens for a name not registered)."""
        if self._targets.pop(name, None) is not None:
            self._resolved.pop(name, None)
            self._changed()

    def on_change(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` whenever :meth:`register` / :meth:`unregister` change the registry (a
        schema made from it is made again)."""
        self._hooks.append(hook)

    def _changed(self) -> None:
        for hook in self._hooks:
            hook()

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {list(self._targets)!r})"
