"""Command-line flags derived from a config dataclass, so each field is declared once.

`add_config_flags(parser, ClusterConfig)` adds a flag for every field: the type comes
from its annotation, choices from a `Literal`, booleans become `--x/--no-x`, a dict
takes JSON, a tuple takes one or more values, and the help text is the docstring
written under the field. A field whose type is itself a dataclass is a section (the
`prefill:` and `transport:` sections of the YAML file): each of its fields gets the
flag `--{section}-{field}` (`--prefill-workers`, `--transport-chunk-bytes`, and one
level deeper `--transport-faults-mode`), in an argument group of the section's own.

A field's metadata may name its flag (`{"flag": "--x"}`), its choices
(`{"choices": [...]}`), its metavar, and the function that parses its value
(`{"type": f}`, for a value the annotation cannot say: a count or `auto`). Every flag's `dest` is the field's dotted path
(`prefill.workers`) and defaults to None, meaning "not given": `config_overrides`
returns only what was given, nested by section like the YAML file, for
`ClusterConfig.load` to lay over it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import textwrap
import types
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under its declaration, across the MRO."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and hasattr(tree.body[0], "body") else []
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


@dataclass(frozen=True)
class ConfigFlag:
    """One leaf field of a config class and the flag that sets it."""

    path: str
    """The field's dotted path from the top class (`transport.faults.mode`); the dest."""
    flag: str
    hint: Any
    """The field's type, Optional unwrapped."""
    default: Any
    doc: str
    metadata: types.MappingProxyType
    section: str | None
    """The top-level section it belongs to, None for a top-level field."""


def config_flags(cls: type, skip: frozenset[str] | set[str] = frozenset()) -> list[ConfigFlag]:
    """Every flag `add_config_flags` adds for `cls`, sections walked depth first; `skip`
    names fields (dotted paths; a section skips all of its fields) that get none."""
    return list(_walk(cls, None, "", None, frozenset(skip)))


def _walk(cls, defaults, prefix: str, section: str | None, skip) -> Iterator[ConfigFlag]:
    """`defaults`: the section's default instance (the parent field's default), whose
    values are its fields' defaults there (the decode pool's differ from the prefill
    pool's); None at the top, where each field's own default applies."""
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    for f in fields(cls):
        path = prefix + f.name
        if path in skip:
            continue
        hint = _unwrap_optional(hints[f.name])
        default = getattr(defaults, f.name) if defaults is not None else _default(f)
        if is_section(hint):
            yield from _walk(hint, default, path + ".", section or path, skip)
            continue
        yield ConfigFlag(
            path=path,
            flag=f.metadata.get("flag", "--" + path.replace(".", "-").replace("_", "-")),
            hint=hint,
            default=default,
            doc=docs.get(f.name, f.name.replace("_", " ")),
            metadata=f.metadata,
            section=section,
        )


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type, skip: frozenset[str] | set[str] = frozenset()
) -> None:
    """A flag per leaf field of `cls` (see the module docstring); a section's flags go in
    an argument group titled with the section's name and described by its docstring."""
    docs = field_docs(cls)
    groups: dict[str | None, Any] = {None: parser}
    for flag in config_flags(cls, skip):
        if flag.section not in groups:
            groups[flag.section] = parser.add_argument_group(
                f"{flag.section} section", docs.get(flag.section)
            )
        kwargs = _argument_kwargs(flag.hint)
        if "type" in flag.metadata:
            kwargs["type"] = flag.metadata["type"]
        if "choices" in flag.metadata:
            kwargs["choices"] = list(flag.metadata["choices"])
        if "metavar" in flag.metadata:
            kwargs["metavar"] = flag.metadata["metavar"]
        elif flag.section is not None and "choices" not in kwargs:
            kwargs.setdefault("metavar", flag.path.rsplit(".", 1)[-1].upper())
        kwargs["help"] = f"{flag.doc} (default: {flag.default!r})".replace("%", "%%")
        groups[flag.section].add_argument(flag.flag, dest=flag.path, default=None, **kwargs)


def config_overrides(
    args: argparse.Namespace, cls: type, skip: frozenset[str] | set[str] = frozenset()
) -> dict:
    """The fields of `cls` given on the command line (flags left out are None), nested by
    section: `{"mode": "colocated", "prefill": {"workers": 2}}`."""
    given: dict = {}
    for flag in config_flags(cls, skip):
        value = getattr(args, flag.path, None)
        if value is None:
            continue
        *sections, name = flag.path.split(".")
        target = given
        for section in sections:
            target = target.setdefault(section, {})
        target[name] = tuple(value) if isinstance(value, list) else value
    return given


def is_section(hint) -> bool:
    """Whether a field of this type is a section of its own (a dataclass)."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def section_type(cls: type, name: str):
    """The dataclass a field of `cls` holds (its section's class), or None for a leaf."""
    hint = _unwrap_optional(get_type_hints(cls)[name])
    return hint if is_section(hint) else None


def _default(f: dataclasses.Field):
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def _unwrap_optional(hint):
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _argument_kwargs(hint) -> dict:
    if get_origin(hint) is Literal:
        choices = list(get_args(hint))
        return {"choices": choices, "type": type(choices[0])}
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if hint in (int, float, str):
        return {"type": hint}
    if hint is dict or get_origin(hint) is dict:
        return {"type": _json_object, "metavar": "JSON"}
    if get_origin(hint) is tuple:
        return {"type": get_args(hint)[0], "nargs": "+"}
    raise TypeError(f"no flag type for {hint!r}")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
