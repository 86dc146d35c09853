"""A text corpus that every machine with Python has: the docstrings of standard-library modules.

Nothing is downloaded and nothing is shipped: the text is read from this Python's own standard library,
so the corpus is the same on every machine with the same Python version. Used by the DiLoCo convergence
benchmark and its test (the NLP task's ``folder`` source reads the ``*.txt`` files written here).
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

MODULES = ("argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
           "datetime", "decimal", "email", "enum", "fractions", "functools", "http.client", "inspect", "json",
           "logging", "multiprocessing", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3",
           "statistics", "string", "subprocess", "tarfile", "threading", "typing", "unittest", "urllib.parse",
           "uuid", "zipfile")


def _docstrings(module) -> list[str]:
    texts = [inspect.getdoc(module) or ""]
    for name in sorted(vars(module)):
        member = getattr(module, name)
        if name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
            continue
        texts.append(inspect.getdoc(member) or "")
    return [text for text in texts if len(text) > 40]


def write_corpus(directory: Path) -> list[Path]:
    """One ``MODULE.txt`` per module of :data:`MODULES`, documents separated by blank lines; returns the files."""
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for name in MODULES:
        path = directory / f"{name}.txt"
        path.write_text("\n\n".join(_docstrings(importlib.import_module(name))) + "\n")
        files.append(path)
    return files
