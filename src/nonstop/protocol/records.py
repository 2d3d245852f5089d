"""Frozen dataclasses read back strictly from JSON values: what a rank reports (``events.py``) and
the policy a rank reads (``rank_policy.py``). Nothing is filled in: a field missing, a value of
another type, or (unless the reader is ``open``) a key the record does not name is refused with
the path to it (``BadRecord``).

Plain dataclasses and hand checks: the rank process reads these, and must not pay for a
validation library's import.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable, Iterable, Literal, Union

Read = Callable[[Any], Any]  # a JSON value -> the value as its type holds it (or BadRecord)


class BadRecord(ValueError):
    """A JSON value that is not the record it should be. ``path``: where in it, filled in as the
    error leaves each record (nothing is spent on paths while every value is right)."""

    def __init__(self, problem: str, path: str = ""):
        super().__init__(problem)
        self.problem, self.path = problem, path

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}" if self.path else self.problem


class Reader:
    """Reads frozen dataclasses, nested ones included, from decoded JSON.

    ``open``: keys a record does not name are passed over (the record is a view of part of a
    larger document), else refused. Each class is taken apart once (a controller of 2,048 hosts
    reads thousands of events a second)."""

    def __init__(self, open: bool = False):
        self.open = open
        # per class: each field's name, the types a value of it is taken as it is in (its
        # scalars: most fields, checked inline), and its reader (the rest)
        self._fields: dict[type, tuple[tuple[str, frozenset[type], Read], ...]] = {}

    def record(self, cls: type, raw: Any, where: str, skip: Iterable[str] = (),
               may_lack: Iterable[str] = ()) -> Any:
        """``raw`` as a ``cls``; BadRecord says what is wrong, from ``where`` on. ``skip``: keys
        the caller reads (a ``type``); ``may_lack``: fields that may be absent, and then take
        their default."""
        try:
            return self._record(cls, raw, skip, may_lack)
        except BadRecord as exc:
            exc.path = where + exc.path
            raise

    def _record(self, cls: type, raw: Any, skip: Iterable[str] = (),
                may_lack: Iterable[str] = ()) -> Any:
        if type(raw) is not dict:
            raise BadRecord(f"{_short(raw)} is not an object")
        fields = self._fields.get(cls) or self._take_apart(cls)
        kwargs: dict[str, Any] = {}
        lacked = 0
        for name, taken, read in fields:
            if name in raw:
                v = raw[name]
                if type(v) in taken:
                    kwargs[name] = v
                    continue
                try:
                    kwargs[name] = read(v)
                except BadRecord as exc:
                    exc.path = f".{name}{exc.path}"
                    raise
            elif name in may_lack:
                kwargs[name] = _default(cls, name)
                lacked += 1
            else:
                raise BadRecord(f"field {name!r} is missing")
        if not self.open and len(raw) - len(kwargs) + lacked > sum(k in raw for k in skip):
            unknown = sorted(set(raw) - set(kwargs) - set(skip))
            if unknown:
                raise BadRecord(f"unknown field(s) {unknown}")
        try:
            # what the frozen dataclass's __init__ does with every field given, at a fraction
            # of its cost (thousands of events a second), then its own checks
            obj = object.__new__(cls)
            obj.__dict__.update(kwargs)
            post = getattr(cls, "__post_init__", None)
            if post is not None:
                post(obj)
            return obj
        except (TypeError, ValueError) as exc:  # its own checks (__post_init__)
            raise BadRecord(str(exc)) from None

    def _take_apart(self, cls: type) -> tuple[tuple[str, frozenset[type], Read], ...]:
        hints = typing.get_type_hints(cls)
        fields = tuple((f.name, _taken(hints[f.name]),
                        self._reader(hints[f.name], f"{cls.__name__}.{f.name}"))
                       for f in dataclasses.fields(cls))
        self._fields[cls] = fields
        return fields

    def _reader(self, hint: Any, field: str) -> Read:
        """A reader of one type: returns the value as the type holds it, or raises BadRecord."""
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            return lambda v: self._record(hint, v)  # type: ignore[arg-type]
        if origin in (Union, types.UnionType):
            alts = [a for a in args if a is not type(None)]
            if len(alts) != len(args):  # X | None: None looked for first
                if len(alts) == 1 and alts[0] in (bool, int, str):
                    kind = alts[0]

                    def plain_or_none(v: Any) -> Any:
                        if v is None or type(v) is kind:
                            return v
                        raise BadRecord(f"{_short(v)} is not {kind.__name__} | None")
                    return plain_or_none
                inner = self._reader(alts[0] if len(alts) == 1 else Union[tuple(alts)], field)
                return lambda v: None if v is None else inner(v)
            each = [self._reader(a, field) for a in args]

            def one_of(v: Any) -> Any:
                for read in each:
                    try:
                        return read(v)
                    except BadRecord:
                        pass
                raise BadRecord(f"{_short(v)} is not {_name(hint)}")
            return one_of
        if origin is Literal:
            allowed = args

            def literal(v: Any) -> Any:
                if any(type(v) is type(a) and v == a for a in allowed):
                    return v
                raise BadRecord(f"{_short(v)} is not one of {list(allowed)}")
            return literal
        if origin is list or origin is tuple:
            if origin is tuple and (len(args) != 2 or args[1] is not Ellipsis):
                raise TypeError(f"{field}: only tuple[X, ...] is read")
            item = self._reader(args[0], field)
            make = list if origin is list else tuple

            def sequence(v: Any) -> Any:
                if type(v) is not list:
                    raise BadRecord(f"{_short(v)} is not a list")
                out = []
                for i, x in enumerate(v):
                    try:
                        out.append(item(x))
                    except BadRecord as exc:
                        exc.path = f"[{i}]{exc.path}"
                        raise
                return make(out)
            return sequence
        if origin is dict:
            if args[0] is not str:
                raise TypeError(f"{field}: a JSON object's keys are strings")
            value = self._reader(args[1], field)

            def mapping(v: Any) -> Any:
                if type(v) is not dict:
                    raise BadRecord(f"{_short(v)} is not an object")
                out = {}
                for k, x in v.items():
                    try:
                        out[k] = value(x)
                    except BadRecord as exc:
                        exc.path = f"[{k!r}]{exc.path}"
                        raise
                return out
            return mapping
        if hint in _PLAIN:
            return _PLAIN[hint]
        # Any included: every field says what it holds
        raise TypeError(f"{field}: {hint!r} cannot be read from JSON")


def _default(cls: type, name: str) -> Any:
    field = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise BadRecord(f"field {name!r} is missing")


def _taken(hint: Any) -> frozenset[type]:
    """The types whose values a field of type ``hint`` holds as they are: bool, int, float (an
    int too: JSON has one kind of number), str, None, and unions of them; None alone for an
    optional field of another type."""
    if hint in _SCALARS:
        return _SCALARS[hint]
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = typing.get_args(hint)
        scalars = [_SCALARS[a] for a in args if a in _SCALARS]
        return frozenset().union(*scalars) if len(scalars) == len(args) else \
            frozenset([type(None)]) if type(None) in args else frozenset()
    return frozenset()


_SCALARS = {bool: frozenset([bool]), int: frozenset([int]), float: frozenset([float, int]),
            str: frozenset([str]), type(None): frozenset([type(None)])}


def _exactly(kind: type) -> Read:
    def read(v: Any) -> Any:
        if type(v) is kind:
            return v
        raise BadRecord(f"{_short(v)} is not {kind.__name__}")
    return read


def _float(v: Any) -> Any:
    # (an int is taken: JSON has one kind of number; a bool is never one)
    if type(v) is float or type(v) is int:
        return v
    raise BadRecord(f"{_short(v)} is not float")


def _none(v: Any) -> None:
    if v is not None:
        raise BadRecord(f"{_short(v)} is not None")


_PLAIN: dict[Any, Read] = {bool: _exactly(bool), int: _exactly(int), float: _float,
                           str: _exactly(str), type(None): _none}


def _name(hint: Any) -> str:
    return str(hint).replace("typing.", "")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def plain(obj: Any) -> Any:
    """A record (and any record in it) as JSON values: an object per dataclass, its fields in
    order."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: plain(x) for k, x in obj.items()}
    return obj
