"""The installed package is the library and its command line: what
setuptools installs from src/ (the packages it finds, and every file in
them that could be package data) holds no test or benchmark tooling; that
lives in support/."""

from __future__ import annotations

import os
import re

import setuptools

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "src")

# Names that say "test tooling" (a module, a package, a data file).
_TOOLING = re.compile(r"(^|[._/])(testing|tests?|conftest|fixtures?|mocks?|support|nccl_reference|forking)($|[._/])")


def installed_files() -> list[str]:
    """Paths, relative to src/, of every file a wheel of this tree may
    install: the packages setuptools finds, all their files (build outputs
    of the extensions aside)."""
    files = []
    for package in setuptools.find_packages(where=SRC):
        folder = os.path.join(SRC, *package.split("."))
        files += [os.path.relpath(os.path.join(dirpath, f), SRC)
                  for dirpath, dirs, names in os.walk(folder) for f in names
                  if "__pycache__" not in dirpath and not f.endswith((".so", ".cpp", ".c", ".pyc"))]
    return sorted(set(files))


def test_the_package_installs_no_test_tooling():
    tooling = [f for f in installed_files() if _TOOLING.search(f)]
    assert not tooling, f"test or benchmark tooling in the installed package: {tooling}"


def test_the_check_sees_tooling():
    assert _TOOLING.search("dfccl/testing/scenarios.py") and _TOOLING.search("dfccl/nccl_reference.py")
    assert not _TOOLING.search("dfccl/bench/harness.py") and not _TOOLING.search("dfccl/scenarios.py")


def test_the_support_package_is_outside_src():
    assert os.path.isfile(os.path.join(ROOT, "support", "dfccl_support", "__init__.py"))
    assert not any(p.startswith("dfccl_support") for p in setuptools.find_packages(where=SRC))
