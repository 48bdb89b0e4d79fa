"""Policy registry: ``@register("name")`` on a policy dataclass, lookup by name with clear errors.

The registry sits below the policies and imports none of them: each policy module registers itself when it is
imported, and ``kvkit/__init__.py`` hands the registry a loader of the built-in policies package
(:func:`set_builtin_loader`), which the first lookup runs. ``import kvkit`` stays free of torch, and every lookup
made after ``import kvkit`` (or ``import kvkit.registry``, which runs the package first) sees the built-in policies."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

#: name -> policy class (a :class:`kvkit.policies.base.Policy` subclass), in registration order
_REGISTRY: dict[str, type] = {}
#: imports the built-in policies (set by ``kvkit/__init__.py``); run once, by the first lookup
_BUILTINS: list[Callable[[], object]] = []


def set_builtin_loader(load: Callable[[], object]) -> None:
    """``load()`` imports the built-in policies (their modules register themselves); the first lookup calls it."""
    _BUILTINS[:] = [load]


def _ensure_builtins() -> None:
    if _BUILTINS:
        load = _BUILTINS.pop()
        try:
            load()
        except BaseException:
            _BUILTINS.append(load)
            raise


def registrar(table: dict[str, type], what: str):
    """A ``@register("name")`` class decorator filling ``table`` (registration order is listing order): it sets
    ``cls.name`` and refuses a name another class holds; ``what`` names the kind of class in that error."""

    def register(name: str):
        def deco(cls):
            if name in table and table[name] is not cls:
                raise ValueError(f"{what} name {name!r} is already registered by {table[name].__name__}")
            cls.name = name
            table[name] = cls
            return cls

        return deco

    return register


#: ``@register("name")`` on a policy dataclass
register = registrar(_REGISTRY, "policy")


def available_policies() -> list[str]:
    """Names of all registered policies, in registry order."""
    _ensure_builtins()
    return list(_REGISTRY)


def policy_class(name: str) -> type:
    _ensure_builtins()
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown kvkit policy {name!r}; known policies: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def policy_options(name: str) -> dict[str, object]:
    """Option names of a policy with their defaults."""
    cls = policy_class(name)
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
        else:
            out[f.name] = None
    return out


def _is_policy(obj) -> bool:
    """Whether ``obj`` is a built policy: an instance of a policy dataclass (registered or a subclass of one), which
    builds stores through ``new_layer``."""
    return (not isinstance(obj, (str, type)) and dataclasses.is_dataclass(obj)
            and callable(getattr(obj, "new_layer", None)))


def get_policy(name, **options):
    """Build a policy by name. Unknown option names raise ValueError listing the valid ones.

    ``name`` may also be an already-built policy instance (then ``options`` must be empty).
    """
    if _is_policy(name):
        if options:
            raise ValueError("pass options either to the policy object or to get_policy, not both")
        return name
    cls = policy_class(name)
    valid = policy_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for policy {name!r}; "
            f"valid options: {', '.join(f'{k}={v!r}' for k, v in valid.items()) or '(none)'}"
        )
    for f in dataclasses.fields(cls):  # a switch given as text ("False") would be truthy: refused, not read
        if f.name in options and f.type in ("bool", bool) and not isinstance(options[f.name], bool):
            raise ValueError(f"{name}: {f.name} must be true or false, got {options[f.name]!r}")
    return cls(**options)


def describe(name: str) -> list[dict]:
    """Every option of a policy, in order: ``{"name", "default", "meaning", "why"}`` -- ``meaning`` the first sentence
    of its entry in the class docstring's numpy-style ``Parameters`` section, ``why`` the comment on its field line
    (the reason for the default: the paper's value, kvkit's measurement). ``kvkit policies NAME`` prints it."""
    import inspect
    import re

    cls = policy_class(name)
    meanings, whys = {}, {}
    for klass in reversed(cls.__mro__):  # the subclass's words win over a base's
        doc = inspect.getdoc(klass) if "__doc__" in vars(klass) else None
        if doc and "Parameters\n----------" in doc:
            body = doc.split("Parameters\n----------", 1)[1]
            entry = None
            for line in body.splitlines():
                if line and not line.startswith(" "):
                    if not re.match(r"[A-Za-z_][\w, ]* :", line) and not re.match(r"[A-Za-z_][\w, ]*$", line):
                        break
                    entry = [n.strip() for n in line.split(":", 1)[0].split(",")]
                    for n in entry:
                        meanings[n] = ""
                elif entry and line.strip():
                    for n in entry:
                        meanings[n] = (meanings[n] + " " + line.strip()).strip()
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for m in re.finditer(r"^    (\w+): [^=\n]+=[^#\n]*#\s*(.+)$", src, re.M):
            whys[m.group(1)] = m.group(2).strip()
    out = []
    for opt, default in policy_options(name).items():
        text = meanings.get(opt, "")
        first = re.split(r"(?<=\.)\s", text, maxsplit=1)[0] if text else ""
        out.append({"name": opt, "default": default, "meaning": first, "why": whys.get(opt, "")})
    return out
