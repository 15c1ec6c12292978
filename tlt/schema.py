"""Typed config fields: a dataclass field with a help string and numeric bounds, and the checks that turn a raw
YAML/CLI/dict value into a field's type with a message that says what is allowed.

tlt.config builds the run's sections from these; tlt.speculative.config builds the speculative-decoding options
(`speculative.*` in a run config, `tlt.LLM(speculative_config=...)`) from the same ones, so that a key is checked
the same way wherever it is written.
"""
import copy
import difflib
import os
import types
from dataclasses import field
from typing import Any, Literal, Union, get_args, get_origin


class UserError(Exception):
    """A mistake in what the user gave (config, data, model, reward function, paths): the message names it and says
    what to do. The command line prints it without a traceback and exits with code 2 (`--debug` shows one)."""


class ConfigError(UserError, ValueError):
    """A config key, type or value is wrong; the message says how to fix it."""


def option(default: Any, description: str, *, ge: float | None = None, gt: float | None = None,
       le: float | None = None) -> Any:
    """A dataclass field with a help string and optional numeric bounds (checked at load)."""
    meta = {"help": description, "ge": ge, "gt": gt, "le": le}
    if isinstance(default, (list, dict, tuple)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return " | ".join(f'"{a}"' for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any) -> Any:
    """Return value converted to tp, or raise TypeError/ValueError (message filled in by the caller)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg)
            except (TypeError, ValueError):
                continue
        raise TypeError
    if origin is Literal:
        if value not in args:
            raise ValueError
        return value
    if origin is list:
        if isinstance(value, (str, int, float)) and get_origin(args[0]) is not list:
            value = [value]  # `data.train_files=a.parquet` means a one-element list
        if not isinstance(value, (list, tuple)):
            raise TypeError
        return [coerce(v, args[0]) for v in value]
    if tp is bool:
        if not isinstance(value, bool):
            raise TypeError
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError
        return value
    if tp is float:
        if isinstance(value, str):
            return float(value)  # YAML 1.1 reads `1e-6` as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError
        return float(value)
    if tp is str:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise TypeError
        return str(value)
    raise TypeError(f"unsupported config type {tp}")


def check_bounds(key: str, value: Any, meta: Any, source: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    bounds = [("ge", ">=", lambda a, b: a >= b), ("gt", ">", lambda a, b: a > b), ("le", "<=", lambda a, b: a <= b)]
    for name, sym, ok in bounds:
        limit = meta.get(name)
        if limit is not None and not ok(value, limit):
            allowed = " and ".join(f"{s} {meta[n]}" for n, s, _ in bounds if meta.get(n) is not None)
            raise ConfigError(f"{key}={value!r} ({source}) is out of range: allowed values are {allowed}")


def close_matches_hint(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def set_option(obj: Any, key: str, value: Any, source: str) -> None:
    """obj.<name> = value for key "<prefix>.<name>" (or "<name>"), after the type and range checks of its field."""
    import dataclasses
    name = key.rsplit(".", 1)[-1]
    fields = {f.name: f for f in dataclasses.fields(obj)}
    f = fields[name]
    try:
        coerced = coerce(value, f.type)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r} ({source}) has the wrong type or value: "
                          f"expected {type_name(f.type)}") from None
    for item in coerced if isinstance(coerced, list) else [coerced]:
        check_bounds(key, item, f.metadata, source)
    setattr(obj, name, coerced)
