"""A package's public names, loaded on first use (PEP 562).

The package root, `checkpoint` and `train` name what they offer here instead of importing it: so
`import eagle3_jax.cli.script` (every script's first import) or `eagle3_jax.checkpoint.atomic`
starts without JAX, and `--help` or a flag mistake answers at once. `import eagle3_jax as e3;
e3.Engine` and `from eagle3_jax import Engine` work as before: the first access imports the
defining module.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping


def lazy_exports(package: str, where: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package` whose public name n lives in module `where[n]`
    (relative to the package, e.g. ".models.target")."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # later lookups find it without coming here
        return value

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__
