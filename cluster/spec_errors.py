"""Spec problems: the typed `SpecError`, YAML reading, and pydantic errors turned into `<dotted.key>: <reason>`.

`cluster.spec.load_spec` calls `read_yaml` (syntax errors with line/column, duplicate keys, non-mapping top
level all become `SpecError`), validates with the pydantic models, and hands any `ValidationError` to
`problems_from_validation`, which names each key as a dotted path (`pools.decode.replicas`), rewrites
pydantic's wording into what a YAML author reads ("expected an integer (got a string)") and adds the fix
where it is obvious (difflib suggestions for misspelt keys and choices). Cross-field validators raise
`SpecError` themselves; their problems are re-rooted at the model that raised them. Never echoes an input
string: a misplaced secret must not end up in a terminal or a log.
"""
from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, ValidationError

from engine.errors import PdserveError

YAML_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
              dict: "a mapping", type(None): "an empty value"}
_NUMERIC_BOUNDS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
_TYPE_WORDS = {"int_type": "an integer", "int_parsing": "an integer", "float_type": "a number",
               "float_parsing": "a number", "string_type": "a string", "bool_type": "a boolean",
               "dict_type": "a mapping", "model_type": "a mapping", "list_type": "a list"}


@dataclass(frozen=True)
class Problem:
    key: str  # dotted path into the spec ("pools.decode.replicas"), a "line L, column C", or "" (whole file)
    reason: str

    def __str__(self) -> str:
        return f"{self.key}: {self.reason}" if self.key else self.reason


class SpecError(PdserveError, ValueError):
    """The cluster spec is malformed or inconsistent; `problems` lists every key at fault and why."""

    def __init__(self, problems: Iterable[Problem], source: str | None = None):
        self.problems = tuple(problems)
        self.source = source
        assert self.problems, "a SpecError needs at least one problem"
        where = f" {source}" if source else ""
        super().__init__(f"invalid cluster spec{where}:\n" + "\n".join(f"  {p}" for p in self.problems))


# ---- YAML ---------------------------------------------------------------------------------------
class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one) and keys that are not
    scalars (a list as a key would raise TypeError, not a YAML error). Merge keys (`<<: *base`) still work:
    only keys written out are checked, so a key may override a merged one."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise yaml.constructor.ConstructorError(None, None, "a key must be a plain name, not a list or "
                                                                    "mapping", key_node.start_mark)
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first defined on line {seen[key]}); keep one",
                    key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file, or `SpecError` naming the line and column of a syntax error."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SpecError([Problem("", f"cannot read {source}: {e.strerror or e}")], source) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise SpecError([_yaml_problem(e)], source) from None
    except RecursionError:  # PyYAML composes recursively: `[[[[...` thousands deep exhausts the stack
        raise SpecError([Problem("", "YAML nested too deeply (thousands of levels); a spec is a few levels "
                                     "of mappings")], source) from None
    if data is None:
        raise SpecError([Problem("", "the file is empty; a spec needs at least `model:` and `pools:`")], source)
    if not isinstance(data, dict):
        raise SpecError([Problem("", f"the top level must be a mapping of keys (model, mode, pools, ...), "
                                     f"got {_yaml_type(data)}")], source)
    return data


def _yaml_problem(e: yaml.YAMLError) -> Problem:
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    kind = "YAML error" if isinstance(e, yaml.constructor.ConstructorError) else "YAML syntax error"
    reason = f"{kind}: {what}" + (f" ({context})" if context else "")
    if mark is None:
        return Problem("", reason)
    return Problem(f"line {mark.line + 1}, column {mark.column + 1}", reason)


def _yaml_type(value: Any) -> str:
    return YAML_TYPES.get(type(value), type(value).__name__)


# ---- pydantic -> problems -----------------------------------------------------------------------
def dotted(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_pydantic_step(part):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _is_pydantic_step(part: str) -> bool:
    """Loc entries pydantic inserts for validators and union branches, not keys of the YAML."""
    return bool(re.match(r"^(function-(after|before|wrap|plain)|tagged-union|chain|lax-or-strict)\[", part))


def problems_from_validation(err: ValidationError, root: type[BaseModel]) -> list[Problem]:
    problems: list[Problem] = []
    for e in err.errors(include_url=False):
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and _is_pydantic_step(p)))
        ctx_error = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_error, SpecError):  # a cross-field validator: re-root its keys
            base = dotted(loc)
            problems += [Problem(".".join(k for k in (base, p.key) if k), p.reason) for p in ctx_error.problems]
            continue
        problems.append(Problem(dotted(loc), _reason(e, loc, root)))
    return problems


def _reason(e: dict[str, Any], loc: tuple, root: type[BaseModel]) -> str:
    kind, value = e["type"], e.get("input")
    if kind == "extra_forbidden":
        return unknown_key_reason(str(loc[-1]), loc[:-1], root)
    if kind == "missing":
        return "required key is missing"
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]} (got {_yaml_type(value)})"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", (e.get("ctx") or {}).get("expected", ""))
        if isinstance(value, str):
            return f"must be one of {', '.join(choices)}{_suggest(value, choices)}"
        return f"must be one of {', '.join(choices)} (got {_yaml_type(value)})"
    if kind in _NUMERIC_BOUNDS:
        return e["msg"].replace("Input should be", "must be") + f" (got {value!r})"
    if kind == "value_error":
        return e["msg"].removeprefix("Value error, ")
    return e["msg"].replace("Input should be", "must be")


def _suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


_TOKEN_KEY = re.compile(r"(hf_|hub_|huggingface_|hugging_face_|use_auth_|access_)?token")


def unknown_key_reason(key: str, parent_loc: tuple, root: type[BaseModel]) -> str:
    """'unknown key ...' plus the likely fix: a close spelling here, the same key elsewhere, or the list."""
    if _TOKEN_KEY.fullmatch(key.lower()):  # a Hugging Face token written into the spec
        return (f"unknown key {key!r}: a Hugging Face token never goes in a spec (specs get committed and "
                f"logged); export HF_TOKEN where `pdserve serve` and the Ray workers run")
    parent = model_at(root, parent_loc)
    allowed = list(parent.model_fields) if parent else []
    hint = _suggest(key, allowed)
    if not hint:
        elsewhere = [p for p in field_paths(root) if p.rsplit(".", 1)[-1] == key]
        if elsewhere:
            hint = f" (it belongs under {', '.join(repr(p.rsplit('.', 1)[0]) for p in elsewhere[:3])})"
        elif allowed:
            hint = f"; allowed keys here: {', '.join(allowed)}"
    return f"unknown key {key!r}{hint}"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (`Pool | None` -> Pool), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if (m := _model_in(arg)) is not None:
                return m
    return None


def model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = _model_in(model.model_fields[part].annotation)
    return model


def field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of the schema, depth first ("pools.prefill.kv.page_size", ...)."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        out.append(path)
        if (sub := _model_in(info.annotation)) is not None:
            out += field_paths(sub, path + ".")
    return out
