"""Built-in policies. Importing this package registers every module in it (one file per policy).

Registry order (what ``kvkit policies`` lists): the baselines first, then the rest alphabetically.
"""

import importlib
import pkgutil

from kvkit.policies.base import Policy

_FIRST = ("full", "streaming")


def _load_all() -> None:
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_") and m.name != "base"]
    for name in sorted(names, key=lambda n: (_FIRST.index(n) if n in _FIRST else len(_FIRST), n)):
        importlib.import_module(f"{__name__}.{name}")


_load_all()

__all__ = ["Policy"]
