"""Frozen dataclasses read back strictly from JSON values: what a rank reports (``events.py``) and
the policy a rank reads (``rank_policy.py``). Nothing is filled in: a field missing, a value of
another type, or (unless the reader is ``open``) a key the record does not name is refused with
the path to it (``BadRecord``).

Plain dataclasses and hand checks: the rank process reads these, and must not pay for a
validation library's import.
"""

from __future__ import annotations

import dataclasses
import operator
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
        self._fast: dict[tuple[type, str, tuple[str, ...], tuple[str, ...]],
                         Callable[[Any], Any]] = {}

    def record(self, cls: type, raw: Any, where: str, skip: Iterable[str] = (),
               may_lack: Iterable[str] = ()) -> Any:
        """``raw`` as a ``cls``; BadRecord says what is wrong, from ``where`` on. ``skip``: keys
        the caller reads (a ``type``); ``may_lack``: fields that may be absent, and then take
        their default."""
        return self.reader(cls, where, tuple(skip), tuple(may_lack))(raw)

    def reader(self, cls: type, where: str, skip: tuple[str, ...] = (),
               may_lack: tuple[str, ...] = ()) -> Callable[[Any], Any]:
        """``record`` for one class, made once: a caller that reads many records keeps it."""
        key = (cls, where, skip, may_lack)
        done = self._fast.get(key)
        if done is not None:
            return done
        fast = self._compile(cls, skip, may_lack)
        slow = self._record

        def read(raw: Any) -> Any:
            if type(raw) is dict:
                obj = fast(raw)
                if obj is not None:
                    return obj
            try:  # not as it should be (or not a dict): this path says what is wrong, and where
                return slow(cls, raw, skip, may_lack)
            except BadRecord as exc:
                exc.path = where + exc.path
                raise
        self._fast[key] = read
        return read

    def _compile(self, cls: type, skip: tuple[str, ...], may_lack: tuple[str, ...]
                 ) -> Callable[[dict[str, Any]], Any]:
        """A reader of ``cls`` made for it, for the common case: every field there and of its
        type. It is written out as Python source, one check per field and no loop, and compiled
        once (as dataclasses makes a class's ``__init__``): a controller of 16,384 ranks reads
        tens of thousands of records in a recovery. It returns None at the first thing amiss,
        and ``_record`` then finds and says what. The same checks as ``_record``'s."""
        fields = self._fields.get(cls) or self._take_apart(cls)
        hints = typing.get_type_hints(cls)
        env: dict[str, Any] = {"_cls": cls, "_new": object.__new__, "_post":
                               getattr(cls, "__post_init__", None), "BadRecord": BadRecord,
                               "_set": object.__setattr__}
        required = sum(1 for name, _, _ in fields if name not in may_lack)
        lines = ["def fast(raw):", f" n = {required}"]
        for i, k in enumerate(skip):
            lines.append(f" if {k!r} in raw: n += 1")
        values = []
        for i, (name, taken, read) in enumerate(fields):
            v = f"v{i}"
            values.append(f"{name!r}: {v}")
            env[f"T{i}"], env[f"R{i}"] = taken, read
            if len(taken) == 1:
                (only,) = taken
                env[f"K{i}"] = only
                wrong = f"{v}.__class__ is not K{i}"
            else:
                wrong = f"{v}.__class__ not in T{i}"
            fix = " return None" if _plain(hints[name]) else f" {v} = R{i}({v})"
            if name in may_lack:
                field = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
                fresh = field.default_factory is not dataclasses.MISSING
                env[f"D{i}"] = field.default_factory if fresh else field.default
                lines += [f" if {name!r} in raw:", f"  {v} = raw[{name!r}]", "  n += 1",
                          f"  if {wrong}:{fix}",
                          f" else: {v} = D{i}{'()' if fresh else ''}"]
            else:  # (one missing: KeyError)
                lines += [f" {v} = raw[{name!r}]", f" if {wrong}:{fix}"]
        if not self.open:
            lines.append(" if len(raw) != n: return None")
        lines += [" obj = _new(_cls)", " _set(obj, '__dict__', {" + ", ".join(values) + "})",
                  " if _post is not None: _post(obj)", " return obj"]
        body = "\n".join(" " + line for line in lines)
        source = (f"def make():\n{body}\n"
                  "  \n"
                  " def guarded(raw):\n"
                  "  try:\n"
                  "   return fast(raw)\n"
                  "  except (KeyError, BadRecord, TypeError, ValueError):\n"
                  "   return None\n"
                  " return guarded\n")
        exec(compile(source, f"<reader of {cls.__name__}>", "exec"), env)  # noqa: S102
        return env["make"]()

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

    def value_reader(self, hint: Any, field: str) -> Read:
        """A reader of a value of type ``hint`` (a record, a list of them, one or None...):
        returns the value as the type holds it, or raises BadRecord with the path to what is
        wrong. ``field`` names it in the TypeError for a type JSON cannot hold."""
        return self._reader(hint, field)

    def _reader(self, hint: Any, field: str) -> Read:
        """A reader of one type: returns the value as the type holds it, or raises BadRecord."""
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            return self.reader(hint, "")  # type: ignore[arg-type]
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
            pairs = frozenset((type(a), a) for a in args)

            def literal(v: Any) -> Any:
                try:
                    if (type(v), v) in pairs:
                        return v
                except TypeError:  # (a list or a dict: not hashable, and not allowed)
                    pass
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


_NOTHING: frozenset[type] = frozenset()  # a field no type alone settles (_compile)


def _plain(hint: Any) -> bool:
    """Whether a value of this type is settled by its type alone (bool, int, float, str, None,
    or a union of them)."""
    if hint in _SCALARS:
        return True
    return typing.get_origin(hint) in (Union, types.UnionType) and \
        all(a in _SCALARS for a in typing.get_args(hint))


def _getter(names: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """The values of ``names`` in a dict, as a tuple (KeyError for one missing)."""
    if not names:
        return lambda raw: ()
    if len(names) == 1:
        name = names[0]
        return lambda raw: (raw[name],)
    return operator.itemgetter(*names)


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
