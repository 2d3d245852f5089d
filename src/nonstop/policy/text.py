"""Policy files as YAML: parse text into a pydantic model, and print a model back as YAML.

Every problem becomes one line naming the file line and the dotted field path (see ``validate``).
"""

from __future__ import annotations

import datetime
import difflib
import types
import typing
from typing import Any, Literal, TypeVar, Union

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ..errors import UsageError

M = TypeVar("M", bound=BaseModel)
Loc = tuple[Union[int, str], ...]
Problem = tuple[Union[int, None], str]  # (1-based line or None, message without the source)

_STR = "tag:yaml.org,2002:str"
_NULL = "tag:yaml.org,2002:null"
_MERGE = "tag:yaml.org,2002:merge"
# Counters, windows and budgets end up in C-level containers and time arithmetic: a number no
# 64-bit integer holds can only be a mistake, and would fail much later, far from the file.
_INT_LIMIT = 2**63 - 1
_SHORT = 60  # longest key or value quoted back in a message


# -- reading ----------------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """SafeLoader whose value errors carry the node's position: PyYAML lets ValueError (a bad
    date, an oversized integer), AttributeError and friends escape construction without one."""

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except Exception as exc:  # any failure to build a value is a bad value at this node
            why = (f"({_one_line(str(exc))})" if isinstance(exc, ValueError)
                   else f"as {str(node.tag).replace('tag:yaml.org,2002:', '!!')}")
            raise ConstructorError(None, None, f"cannot read this value {why}",
                                   node.start_mark) from None

    def construct_yaml_int(self, node: Node) -> int:
        try:
            value = super().construct_yaml_int(node)
        except ValueError:
            value = None
        if value is None or abs(value) > _INT_LIMIT:
            text = str(node.value)
            digits = text.strip().lstrip("+-").replace("_", "").replace(":", "")
            what = "integer too large" if digits.isalnum() else "not an integer"
            raise ConstructorError(None, None, f"{what} ({_short(text)})", node.start_mark)
        return value


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def validate(text: str, source: str, model: type[M]) -> M:
    """``text`` as an instance of ``model``; an empty document gives the defaults.

    Raises UsageError ``"<source> line <n>: <problem>"`` (one line) for anything wrong, the
    problem nearest the top of the text when there are several."""
    root, data = _read(text, source, model)
    if root is None or data is None:
        return model()
    if not isinstance(data, dict):
        _fail(source, [(_line(root), f"expected a mapping at the top level (got {_kind(data)})")])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        _fail(source, explain(exc, model, root))
    except RecursionError:  # a self-referencing alias nested where pydantic follows it
        _fail(source, [(_line(root), "nested too deeply")])


def _read(text: str, source: str, model: type[BaseModel]) -> tuple[Node | None, Any]:
    """The node tree (for line numbers) and the data built from it."""
    loader: _Loader | None = None
    try:
        loader = _Loader(text)
        root = loader.get_single_node()
        if root is None:
            return None, None
        # Before construction: merge keys (<<) are flattened into the nodes while building, and
        # a key that is overridden by design must not look like a duplicate.
        problems = _check_keys(root, model, ())
        if problems:
            _fail(source, problems)
        return root, loader.construct_document(root)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, max(exc.position, 0)) + 1
        what = (f"character {exc.character:#06x} is not allowed" if isinstance(exc.character, int)
                else str(exc.reason))
        _fail(source, [(line, f"not valid YAML ({what})")])
    except ConstructorError as exc:
        problem = str(exc.problem or exc.context or "cannot read this value")
        _fail(source, [(_mark_line(exc), problem.replace("tag:yaml.org,2002:", "!!"))])
    except yaml.MarkedYAMLError as exc:
        problem = str(exc.problem or exc.context or type(exc).__name__)
        if exc.context and problem.startswith("but "):  # "but found another document"
            problem = f"{exc.context}, {problem}"
        if "'\\t'" in problem:
            problem += "; indent with spaces, not tabs"
        _fail(source, [(_mark_line(exc), f"not valid YAML ({problem})")])
    except yaml.YAMLError as exc:
        _fail(source, [(None, f"not valid YAML ({type(exc).__name__})")])
    except RecursionError:  # PyYAML composes recursively: thousands of nested brackets
        _fail(source, [(None, "not valid YAML (nested too deeply)")])
    finally:
        if loader is not None:
            loader.dispose()


def _check_keys(node: Node, model: type[BaseModel], loc: Loc) -> list[Problem]:
    """What pydantic cannot see once YAML became a dict: duplicate keys (the last silently wins)
    and keys that are not text (``1:``, ``yes:``), in every mapping the schema reads."""
    tp = _type_at(model, loc)
    problems: list[Problem] = []
    if _is_model(tp) and isinstance(node, MappingNode):
        seen: dict[str, Node] = {}
        for key, value in node.value:
            if key.tag == _MERGE or not isinstance(key, ScalarNode):
                continue  # merges are resolved later; the constructor rejects collection keys
            if key.tag != _STR:
                name = _scalar_text(key)
                problems.append((_line(key), f"unknown key '{_dotted(loc + (name,))}'"
                                 + _suggest(model, loc, name)))
                continue
            if key.value in seen:
                problems.append((_line(key), f"duplicate key '{_dotted(loc + (key.value,))}' "
                                             f"(first at line {_line(seen[key.value])})"))
            seen[key.value] = key
            if key.value in tp.model_fields:
                problems += _check_keys(value, model, loc + (key.value,))
    elif typing.get_origin(tp) is list and isinstance(node, SequenceNode):
        for i, item in enumerate(node.value):
            problems += _check_keys(item, model, loc + (i,))
    return problems


# -- explaining validation errors ----------------------------------------------------------------
def explain(err: ValidationError, model: type[BaseModel], root: Node | None) -> list[Problem]:
    """One (line, message) per pydantic error; ``root`` is the YAML node tree the data came from
    (None: no file, the message quotes the input value instead)."""
    return [_explain_one(e, model, root) for e in err.errors()]


def _explain_one(e: ErrorDetails, model: type[BaseModel], root: Node | None) -> Problem:
    loc: Loc = tuple(e["loc"])
    kind = e["type"]
    line, node = _locate(root, loc) if root is not None else (None, None)
    path = _dotted(loc)
    if kind in ("extra_forbidden", "invalid_key"):
        return line, f"unknown key '{path}'" + (_suggest(model, loc[:-1], str(loc[-1])) if loc else "")
    if kind == "missing" and loc:
        parent_path = _dotted(loc[:-1])
        where = f"{parent_path}: " if parent_path else ""
        return line, f"{where}missing field '{_part(loc[-1])}'"
    msg = _message(e)
    notes = [_got(kind, node, e.get("input"), root is not None)]
    if kind == "literal_error":
        notes.append(_suggest_literal(_type_at(model, loc), e.get("input")))
    notes = [n for n in notes if n]
    if notes:
        msg += f" ({'; '.join(notes)})"
    return line, f"{path}: {msg}" if path else msg


def _message(e: ErrorDetails) -> str:
    kind = e["type"]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "Input should be a mapping of fields"
    if kind == "list_type":
        return "Input should be a list"
    msg = str(e["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    return msg


def _got(kind: str, node: Node | None, value: Any, from_yaml: bool) -> str:
    """``got <the value as written>`` where that helps; empty for errors about a whole mapping
    (a cross-field check), where the value is the mapping the path already names."""
    if from_yaml:
        if node is None:
            return ""
        if isinstance(node, ScalarNode):
            got = _scalar_text(node)
            if kind == "string_type" and node.tag != _STR:
                return f"got {got}; quote it to make it text"
            return f"got {got}"
        if kind.endswith("_type") or kind.endswith("_parsing"):
            return f"got {'a mapping' if isinstance(node, MappingNode) else 'a list'}"
        return ""
    if isinstance(value, (dict, list, tuple, set)):
        return f"got {_kind(value)}" if kind.endswith("_type") else ""
    return f"got {_value_text(value)}"


def _locate(root: Node, loc: Loc) -> tuple[int, Node | None]:
    """The line of the field at ``loc`` and its node; the nearest parent's line (and None) where
    the path leaves the file (a missing field, a default)."""
    node: Node = root
    line = _line(root)
    for part in loc:
        if isinstance(node, MappingNode):
            found = None
            for key, value in node.value:  # the last one wins, as in the dict built from it
                if isinstance(key, ScalarNode) and key.tag == _STR and key.value == part:
                    found = (key, value)
            if found is None:
                return line, None
            key, node = found
            # a scalar's line is where the value is; a block's line is where its key is
            line = _line(node if isinstance(node, ScalarNode) else key)
        elif (isinstance(node, SequenceNode) and isinstance(part, int)
              and 0 <= part < len(node.value)):
            node = node.value[part]
            line = _line(node)
        else:
            return line, None
    return line, node


# -- the schema, for suggestions ---------------------------------------------------------------------
def _unwrap(tp: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _type_at(tp: Any, loc: Loc) -> Any:
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(part, int) and typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        elif isinstance(part, str) and _is_model(tp) and part in tp.model_fields:
            tp = tp.model_fields[part].annotation
        else:
            return None
    return _unwrap(tp)


def _field_paths(model: type[BaseModel]) -> list[tuple[str, str]]:
    """(name, dotted path) of every field outside lists, shallowest first."""
    out: list[tuple[str, str]] = []
    queue: list[tuple[Any, str]] = [(model, "")]
    while queue:
        tp, prefix = queue.pop(0)
        for name, field in tp.model_fields.items():
            out.append((name, prefix + name))
            inner = _unwrap(field.annotation)
            if _is_model(inner):
                queue.append((inner, f"{prefix}{name}."))
    return out


def _suggest(model: type[BaseModel], parent: Loc, key: str) -> str:
    """`` (did you mean 'x'?)``: a close field name under ``parent``, else the dotted path of a
    field of that exact name elsewhere in ``model`` (a key written at the wrong level)."""
    key = key[:100]  # difflib is quadratic; no field name is this long
    here = _type_at(model, parent)
    if _is_model(here):
        by_lower = {name.lower(): name for name in here.model_fields}
        close = difflib.get_close_matches(key.lower(), list(by_lower), n=1)
        if close:
            return f" (did you mean '{by_lower[close[0]]}'?)"
    for name, path in _field_paths(model):
        if name == key:
            return f" (did you mean '{path}'?)"
    return ""


def _suggest_literal(tp: Any, value: Any) -> str:
    if typing.get_origin(tp) is not Literal or not isinstance(value, str):
        return ""
    choices = [str(a) for a in typing.get_args(tp)]
    close = difflib.get_close_matches(value[:100], choices, n=1)
    return f"did you mean '{close[0]}'?" if close else ""


# -- formatting ---------------------------------------------------------------------------------------
def _fail(source: str, problems: list[Problem]) -> typing.NoReturn:
    # The first problem in the file: fixing from the top down is how people read a file.
    line, msg = min(problems, key=lambda p: (p[0] is None, p[0] or 0))
    where = f"{source} line {line}" if line is not None else source
    raise UsageError(f"{where}: {_one_line(msg)}")


def fail_without_file(source: str, err: ValidationError, model: type[BaseModel]) -> typing.NoReturn:
    """Raise UsageError for values that came from code or flags, not from a file."""
    _fail(source, explain(err, model, None))


def _one_line(text: str) -> str:
    return " ".join(text.splitlines()) if text else text


def _short(text: str) -> str:
    return text if len(text) <= _SHORT else text[:_SHORT - 1] + "…"


def _part(part: int | str) -> str:
    if isinstance(part, str):
        return _short(part if part.isprintable() and part else repr(part)[1:-1] or "''")
    return str(part)


def _dotted(loc: Loc) -> str:
    return ".".join(_part(p) for p in loc)


def _scalar_text(node: ScalarNode) -> str:
    if node.tag == _NULL:
        return "null"
    if node.tag == _STR:
        return _value_text(node.value)
    return _short(node.value) if node.value.isprintable() else _short(repr(node.value))


def _value_text(value: Any) -> str:
    if isinstance(value, str):
        return _short(repr(value))
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "null"
    if isinstance(value, int):  # str() of a huge int raises, and would be unreadable anyway
        return str(value) if value.bit_length() < 200 else "a very large integer"
    if isinstance(value, (float, datetime.date)):
        return str(value)
    return _kind(value)


def _kind(value: Any) -> str:
    kinds = {dict: "a mapping", list: "a list", tuple: "a list", set: "a set", bytes: "binary data"}
    for tp, name in kinds.items():
        if isinstance(value, tp):
            return name
    if isinstance(value, (str, int, float, bool)) or value is None:
        return _value_text(value)
    return f"a {type(value).__name__}"


def _line(node: Node) -> int:
    return node.start_mark.line + 1


def _mark_line(exc: yaml.MarkedYAMLError) -> int | None:
    mark = exc.problem_mark or exc.context_mark
    return mark.line + 1 if mark is not None else None


# -- writing --------------------------------------------------------------------------------------------
class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # equal sub-objects are written out each time, never as &anchors

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)  # list items indented under their key


def dump(data: dict[str, Any], header: str = "") -> str:
    """``data`` as block YAML in its own key order, a blank line between top-level sections.

    Non-ASCII text is written as escapes: the output always prints, whatever the terminal."""
    body = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=False, width=10_000, indent=2)
    tops = tuple(f"{k}:" for k in data)
    lines = [f"# {h}" if h else "#" for h in header.splitlines()]
    for line in body.splitlines():
        if lines and line.startswith(tops):
            lines.append("")
        lines.append(line)
    return "\n".join(lines) + "\n"
