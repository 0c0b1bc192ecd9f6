"""Optional dependencies, installed as pip extras (pyproject.toml): `serve` (the OpenAI server),
`bench` (the benchmark's HTTP client and plots), `train` (draft and target training).

`import eagle3_jax` and the engine need none of them; the code that does imports its module with
`require`, where it is used, so that a missing one is one clear line naming the extra to install.
"""

from __future__ import annotations

import importlib
import types


class MissingExtraError(ImportError):
    """An optional dependency that is not installed, with the pip command that installs it."""


def require(module: str, extra: str, purpose: str) -> types.ModuleType:
    """`module`, imported; MissingExtraError naming the extra that provides it when it is missing.

    `purpose` says what needs it ("the OpenAI server"): the message reads
    "<purpose> needs <module>, which is not installed: pip install 'eagle3-jax[<extra>]'".
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.partition(".")[0]
        # Only the module itself (or its package) missing is the user's install; an ImportError
        # from inside an installed module is a broken install and keeps its own message.
        if e.name is not None and e.name not in (module, top) and not module.startswith(e.name + "."):
            raise
        raise MissingExtraError(f"{purpose} needs {top}, which is not installed: "
                                f"pip install 'eagle3-jax[{extra}]'") from e
