"""The checks every config of mmrl is built with: `ConfigError` and the helpers that turn plain data
(YAML) into typed dataclasses, with one-line errors that name the key, the bad value and what is
accepted. A leaf module (it imports nothing of mmrl): the run config, the policies', rewards' and
stages' configs all use it.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, Literal


class ConfigError(ValueError):
    """A malformed config: the message names the key, the bad value and the valid choices."""


class RunMismatchError(ConfigError):
    """A run folder already holds a run of another config."""



def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp, key: str):
    """Check `value` against the annotation `tp`, converting ints to floats where a float is due."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: invalid value {value!r}; valid: {', '.join(map(str, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {_type_name(tp)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, key)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def build_dataclass(cls, data: Any, prefix: str = ""):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # not the fields a class fills itself
    unknown = [k for k in data if k not in names]
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown key '{where}{unknown[0]}'; valid keys here: {', '.join(names)}")
    kwargs = {k: coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in data.items()}
    return cls(**kwargs)


def check_params(fn: Callable, params: dict[str, Any], where: str, skip: int = 0,
                 internal: tuple[str, ...] = ()) -> None:
    """The params of a component configured by its signature (a task's `__init__`, a reward
    function), checked as a dataclass of that signature would be: raise ConfigError naming a
    parameter `fn` does not take (after its first `skip` positional ones; `internal` parameters
    are the caller's to pass, never a config's), or a value that does not fit its annotation."""
    sig = inspect.signature(fn)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    valid = [n for n in list(sig.parameters)[skip:]
             if sig.parameters[n].kind is not inspect.Parameter.VAR_POSITIONAL and n not in internal]
    check_names(params, valid, where)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve here: the names are checked, not the types
        return
    for name, value in params.items():
        if name in hints:
            try:
                coerce(value, hints[name], name)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None


def check_names(params: dict[str, Any], valid: list[str], where: str, kind: str = "parameter") -> None:
    """Raise ConfigError (a ValueError) naming the first key of `params` not in `valid`, and the valid ones."""
    unknown = [k for k in params if k not in valid]
    if unknown:
        raise ConfigError(f"{where}: unknown {kind} {unknown[0]!r}; valid: {', '.join(valid) or '(none)'}")


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)
