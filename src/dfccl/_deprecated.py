"""Names kept for one release after a rename (design decision 43): using one
warns with DeprecationWarning and does what the new name does."""

from __future__ import annotations

import functools
import importlib
import warnings

from dfccl.errors import InvalidArgumentError

__all__ = ["renamed_attributes", "renamed_keywords", "renamed_property"]


def _warn(old: str, new: str) -> None:
    # stacklevel 3: the caller of the renamed thing, past this helper and its wrapper.
    warnings.warn(f"{old} is deprecated and goes in the next release: use {new}", DeprecationWarning, stacklevel=3)


def renamed_attributes(module: str, renames: dict[str, str]):
    """A module ``__getattr__`` giving ``renames`` (old name -> new name,
    both in ``module``) with a warning."""
    def __getattr__(name: str):
        new = renames.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        _warn(f"{module}.{name}", f"{module}.{new}")
        return getattr(importlib.import_module(module), new)
    return __getattr__


def renamed_keywords(**renames: str):
    """Decorates a function so that it takes each keyword of ``renames``
    (old=new) under its old name too, with a warning."""
    def decorate(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise InvalidArgumentError(f"{fn.__qualname__}: pass {new}= only ({old}= is its old name)")
                    _warn(f"{fn.__qualname__}({old}=)", f"{new}=")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return call
    return decorate


def renamed_property(owner: str, old: str, new: str) -> property:
    """A read-only property ``old`` of class ``owner`` giving ``new`` with a warning."""
    def get(self):
        _warn(f"{owner}.{old}", f"{owner}.{new}")
        return getattr(self, new)
    return property(get, doc=f"Deprecated name of ``{new}``.")
