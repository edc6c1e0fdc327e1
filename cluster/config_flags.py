"""Command-line flags derived from a config dataclass, so each field is declared once.

`add_config_flags(parser, ClusterConfig)` adds `--field-name` for every field: the
type comes from its annotation, choices from a `Literal`, booleans become
`--x/--no-x`, a dict takes JSON, a tuple takes one or more values, and the help text
is the docstring written under the field. A field's metadata may name its flag
(`{"flag": "--x"}`), its choices (`{"choices": [...]}`) and its metavar. Flags default to None, meaning "not given": `config_overrides` returns
only what was given, for `ClusterConfig.load` to lay over the YAML file.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import json
import textwrap
import types
from dataclasses import MISSING, fields
from typing import Literal, Union, get_args, get_origin, get_type_hints


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


def add_config_flags(parser: argparse.ArgumentParser, cls: type, skip: set[str] = frozenset()):
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        doc = docs.get(f.name, f.name.replace("_", " "))
        kwargs = _argument_kwargs(_unwrap_optional(hints[f.name]))
        if "choices" in f.metadata:
            kwargs["choices"] = list(f.metadata["choices"])
        if "metavar" in f.metadata:
            kwargs["metavar"] = f.metadata["metavar"]
        kwargs["help"] = f"{doc} (default: {default!r})".replace("%", "%%")
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        parser.add_argument(flag, dest=f.name, default=None, **kwargs)


def config_overrides(args: argparse.Namespace, cls: type) -> dict:
    """The fields of `cls` given on the command line (flags left out are None)."""
    given = {f.name: getattr(args, f.name, None) for f in fields(cls)}
    return {
        name: tuple(value) if isinstance(value, list) else value
        for name, value in given.items()
        if value is not None
    }


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
