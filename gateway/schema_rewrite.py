"""JSON Schema as clients send it, rewritten into the subset the grammar compiler (llguidance) enforces.

Real schemas (GitHub workflows, Kubernetes objects, package.json, Snowplow events, what the OpenAI SDK's
``.parse()`` makes of pydantic models) use keywords llguidance refuses: ``oneOf``, ``not``,
``dependencies``, ``if``/``then``/``else``, formats it does not know, ``minProperties`` beside optional
keys, ``uniqueItems``... Each is rewritten here into keywords it does enforce, and every rewrite is
**sound**: an instance the rewritten schema accepts is valid against the original. Most are exact; a
few narrow what the model may write (named below), and none widens it, so an answer never fails the
schema the client sent. What cannot be rewritten soundly is refused with the keyword and its JSON
pointer (:class:`Unsupported`), never approximated.

The rewrites:
- ``format`` that llguidance does not know: dropped. JSON Schema makes ``format`` an annotation unless
  a validator opts in, so this is exact.
- ``oneOf``: ``anyOf`` when the branches exclude each other (proved from types, constants, a required
  discriminator property, a key one branch requires and another forbids). Otherwise each branch is made
  to exclude the others (forbidding a key another branch requires, or adding the other's negation), and
  a branch that cannot be is dropped (narrowing).
- ``dependentRequired`` / ``dependentSchemas`` / ``dependencies``: "key absent, or key present and the
  rest": an ``anyOf`` beside the object (exact).
- ``not``: its negation, built from the keywords it holds (types, constants and enums, bounds,
  ``required``, ``properties``, ``anyOf``/``allOf``, ``$ref``); for a node that lists its values
  (``enum``/``const``) the values the ``not`` rules out are removed (exact).
- ``if``/``then``/``else``: ``anyOf: [if and then, not-if and else]`` (exact, as ``not``).
- ``minProperties``/``maxProperties`` beside optional properties: at least n of the listed keys
  (``anyOf`` of required choices) / at most m of them (the others forbidden; narrowing).
- ``uniqueItems``: at most one item (narrowing: every such array is unique).
- ``contains``/``minContains``: the first items match it (narrowing).
- ``propertyNames``: applied to the listed keys, and to the others as ``patternProperties``.
- ``unevaluatedProperties``/``unevaluatedItems``: as ``additionalProperties``/``items`` (narrowing).
- draft-04's boolean ``exclusiveMinimum``/``exclusiveMaximum`` and draft-07's array ``items``: their
  2020-12 forms (exact).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Unsupported", "rewrite"]

Schema = Any  # a dict, or True/False

# JSON Schema's type names; "integer" is a subset of "number".
TYPES = ("null", "boolean", "object", "array", "number", "string")
ALL_TYPES = frozenset((*TYPES, "integer"))
# Keywords that only annotate: vacuous for validation.
ANNOTATIONS = frozenset(
    (
        "title",
        "description",
        "default",
        "examples",
        "example",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$id",
        "id",
        "$schema",
        "$anchor",
        "$dynamicAnchor",
        "$vocabulary",
        "$defs",
        "definitions",
        "format",
        "contentMediaType",
        "contentEncoding",
        "contentSchema",
        "nullable",
        "discriminator",
        "xml",
        "externalDocs",
    )
)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_VALUES = (
    "additionalProperties",
    "additionalItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
)
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
MAX_BRANCHES = 64  # anyOf branches one rewrite may make (choices of keys, complements of values)
MAX_DEPTH = 12  # nesting of negations and $ref resolutions inside one analysis
MAX_COMPLEMENT_CHARS = 256  # constants a string complement (a regex) is built for, in all


class Unsupported(Exception):
    """A keyword that cannot be enforced soundly: its name, where it is (a JSON pointer), and why."""

    def __init__(self, keyword: str, pointer: str, why: str) -> None:
        super().__init__(f"{keyword} at {pointer or '/'}: {why}")
        self.keyword = keyword
        self.pointer = pointer or "/"
        self.why = why


def rewrite(schema: dict[str, Any], known_format: Callable[[str], bool]) -> dict[str, Any]:
    """A new schema llguidance can compile that accepts only instances ``schema`` accepts.

    ``known_format(name)``: whether the compiler enforces that string format (others are dropped).
    Raises Unsupported naming the first keyword that cannot be rewritten soundly.
    """
    doc = {k: v for k, v in schema.items() if k != "x-guidance"}  # the compiler's options are ours to set
    out = _Rewriter(doc, known_format).node(doc, "")
    # which draft the schema follows is read here (draft-04 bounds, draft-07 items); the compiler would
    # try to fetch a $schema it does not know (a Snowplow or Iglu meta-schema) and fail
    out.pop("$schema", None)
    return out


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


class _Rewriter:
    def __init__(self, root: dict[str, Any], known_format: Callable[[str], bool]) -> None:
        self.root = root
        self.known_format = known_format
        self._validators: dict[str, Callable[[Any], bool]] = {}  # by the sub-schema's JSON

    # -- the walk: children first, then this node's own keywords ---------------------------------

    def node(self, schema: Schema, at: str) -> Schema:
        if not isinstance(schema, dict):
            return schema
        out: dict[str, Any] = {}
        for key, value in schema.items():
            where = f"{at}/{_escape(key)}"
            if key in SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {k: self.node(v, f"{where}/{_escape(k)}") for k, v in value.items()}
            elif key in SCHEMA_VALUES:
                out[key] = self.node(value, where)
            elif key in SCHEMA_LISTS and isinstance(value, list):
                out[key] = [self.node(v, f"{where}/{i}") for i, v in enumerate(value)]
            elif key == "items":
                out[key] = (
                    [self.node(v, f"{where}/{i}") for i, v in enumerate(value)]
                    if isinstance(value, list)
                    else self.node(value, where)
                )
            elif key == "dependencies" and isinstance(value, dict):
                out[key] = {
                    k: v if isinstance(v, list) else self.node(v, f"{where}/{_escape(k)}") for k, v in value.items()
                }
            else:
                out[key] = value
        return self.own(out, schema, at)

    def own(self, node: dict[str, Any], original: dict[str, Any], at: str) -> dict[str, Any]:
        """This node's keywords the compiler does not take, rewritten (children are done already)."""
        self._format(node)
        self._draft4_bounds(node)
        self._draft7_items(node)
        if isinstance(node.get("$ref"), str) and not node["$ref"].startswith("#"):
            raise Unsupported("$ref", f"{at}/$ref", "only references inside the schema (#/...) can be followed")
        self._dependencies(node, at)
        self._not(node, original, at)
        self._conditional(node, original, at)
        self._one_of(node, original, at)
        self._property_counts(node, at)
        self._unique_items(node, at)
        self._contains(node, at)
        self._property_names(node, at)
        self._unevaluated(node)
        return node

    def _unevaluated(self, node: dict[str, Any]) -> None:
        """``unevaluatedProperties`` as ``additionalProperties`` over the keys this node and its allOf and
        $ref always evaluate (narrowing: keys only an anyOf branch evaluates are not allowed)."""
        if "unevaluatedItems" in node:
            value = node.pop("unevaluatedItems")
            if "items" not in node and value is not True:
                node["items"] = value
        if "unevaluatedProperties" not in node:
            return
        value = node.pop("unevaluatedProperties")
        if "additionalProperties" in node or value is True:
            return  # additionalProperties already evaluates every other key
        listed = dict(node.get("properties", {}))
        for key in self.facts(node, 0).properties:
            listed.setdefault(key, True)  # its schema is applied where it is defined (allOf, $ref)
        node["properties"] = listed
        node["additionalProperties"] = value

    # -- exact rewrites of older drafts and annotations ----------------------------------------------

    def _format(self, node: dict[str, Any]) -> None:
        fmt = node.get("format")
        if fmt is not None and (not isinstance(fmt, str) or not self.known_format(fmt)):
            del node["format"]  # an annotation: JSON Schema validators ignore unknown formats

    @staticmethod
    def _draft4_bounds(node: dict[str, Any]) -> None:
        for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(node.get(flag), bool):
                if node.pop(flag) and bound in node:
                    node[flag] = node.pop(bound)

    @staticmethod
    def _draft7_items(node: dict[str, Any]) -> None:
        if isinstance(node.get("items"), list):
            node["prefixItems"] = node.pop("items")
            if "additionalItems" in node:
                node["items"] = node.pop("additionalItems")
        else:
            node.pop("additionalItems", None)  # without an items array it has no effect

    # -- dependencies ---------------------------------------------------------------------------

    def _dependencies(self, node: dict[str, Any], at: str) -> None:
        required: dict[str, list[str]] = {}
        schemas: dict[str, Schema] = {}
        for key, value in node.pop("dependencies", {}).items():
            (required if isinstance(value, list) else schemas)[key] = value
        required |= node.pop("dependentRequired", {})
        schemas |= node.pop("dependentSchemas", {})
        if not required and not schemas:
            return
        always = set(node.get("required", []))
        for key, needs in required.items():
            if key in always:
                node["required"] = [*node.get("required", []), *(n for n in needs if n not in always)]
                always |= set(needs)
            elif self._may_have(node, key):
                _add_all(node, {"anyOf": [{"required": [key, *needs]}, {"properties": {key: False}}]})
        for key, extra in schemas.items():
            if key in always:
                _add_all(node, extra)
            elif self._may_have(node, key) and extra is not True:
                _add_all(node, {"anyOf": [{"required": [key], "allOf": [extra]}, {"properties": {key: False}}]})

    @staticmethod
    def _may_have(node: dict[str, Any], key: str) -> bool:
        """Whether an instance of ``node`` may hold ``key`` (False only where that is certain)."""
        props = node.get("properties", {})
        if key in props:
            return props[key] is not False
        return node.get("additionalProperties", True) is not False or bool(node.get("patternProperties"))

    # -- not, if/then/else ------------------------------------------------------------------------

    def _not(self, node: dict[str, Any], original: dict[str, Any], at: str) -> None:
        if "not" not in node:
            return
        node.pop("not")
        negated = original["not"]
        if self._filter_values(node, lambda v: not self._valid(v, negated)):
            return
        complement = self.negate(negated, 0)
        if complement is None:
            raise Unsupported("not", f"{at}/not", "its negation cannot be written as a grammar")
        _add_all(node, complement)

    def _conditional(self, node: dict[str, Any], original: dict[str, Any], at: str) -> None:
        if "if" not in node:
            node.pop("then", None)
            node.pop("else", None)
            return
        cond = original["if"]
        rewritten_cond = node.pop("if")
        then, otherwise = node.pop("then", True), node.pop("else", True)
        if then is True and otherwise is True:
            return
        orig_then, orig_else = original.get("then", True), original.get("else", True)
        if self._filter_values(
            node, lambda v: self._valid(v, orig_then) if self._valid(v, cond) else self._valid(v, orig_else)
        ):
            return
        negated = self.negate(cond, 0)
        if negated is None:
            raise Unsupported("if", f"{at}/if", "its negation (the else case) cannot be written as a grammar")
        yes = {"allOf": [rewritten_cond, then]}
        no = negated if otherwise is True else {"allOf": [negated, otherwise]}
        _add_all(node, {"anyOf": [yes, no]})

    # -- oneOf ----------------------------------------------------------------------------------

    def _one_of(self, node: dict[str, Any], original: dict[str, Any], at: str) -> None:
        if "oneOf" not in node:
            return
        branches: list[Schema] = node.pop("oneOf")
        raw: list[Schema] = original["oneOf"]
        if self._filter_values(node, lambda v: sum(self._valid(v, b) for b in raw) == 1):
            return
        n = len(branches)
        disjoint = [[i == j or self.disjoint(raw[i], raw[j], 0) for j in range(n)] for i in range(n)]
        kept: list[Schema] = []
        for i in range(n):
            narrowed: list[Schema] = []
            for j in range(n):
                if disjoint[i][j]:
                    continue
                exclusion = self._exclusion(raw[i], raw[j])
                if exclusion is None or self.disjoint(raw[i], exclusion, 0):
                    break  # this branch cannot be told from the other's instances: dropped (narrowing)
                narrowed.append(exclusion)
            else:
                kept.append({"allOf": [branches[i], *narrowed]} if narrowed else branches[i])
        if not kept:
            raise Unsupported(
                "oneOf", f"{at}/oneOf", "its branches overlap in a way that cannot be told apart as a grammar"
            )
        _add_all(node, {"anyOf": kept})

    def _exclusion(self, mine: Schema, other: Schema) -> Schema | None:
        """A schema that, beside ``mine``, rules out every instance of ``other`` (None: none found)."""
        a, b = self.facts(mine, 0), self.facts(other, 0)
        objects = {"object"}
        # forbidding a key ``other`` requires rules out its objects; its other instances must be ruled out too
        only_objects = b.types is not None and b.types <= objects
        if only_objects or a.types is not None and a.types <= objects:
            for key in sorted(b.required - a.required):
                return {"properties": {key: False}} if only_objects else {"type": "object", "properties": {key: False}}
        return self.negate(other, 0)

    # -- property counts, uniqueItems, contains, propertyNames ------------------------------------

    def _property_counts(self, node: dict[str, Any], at: str) -> None:
        props = node.get("properties", {})
        required = set(node.get("required", []))
        optional = [k for k, v in props.items() if k not in required and v is not False]
        if not optional:
            return  # every listed key is required: the compiler takes the bounds as they are
        closed = node.get("additionalProperties", True) is False and not node.get("patternProperties")
        low = node.pop("minProperties", 0)
        if isinstance(low, int) and low > len(required):
            need = low - len(required)
            if need > len(optional):
                if closed:
                    raise Unsupported("minProperties", f"{at}/minProperties", "more than the keys it allows")
                raise Unsupported(
                    "minProperties", f"{at}/minProperties", "it would need keys beyond those listed in properties"
                )
            choices = list(_choices(optional, need))
            if len(choices) <= MAX_BRANCHES:
                _add_all(node, {"anyOf": [{"required": list(c)} for c in choices]})
            else:  # narrowing: the first keys listed
                node["required"] = [*node.get("required", []), *optional[:need]]
        high = node.pop("maxProperties", None)
        if isinstance(high, int):
            allowed = high - len(required)
            if allowed < 0:
                raise Unsupported("maxProperties", f"{at}/maxProperties", "fewer than the keys it requires")
            extra = {"additionalProperties": False} if not closed else {}
            if len(optional) > allowed or extra:  # narrowing: the optional keys past the first ``allowed`` go
                node["properties"] = {
                    k: (False if k in optional[allowed:] else v) for k, v in node.get("properties", {}).items()
                }
                node.update(extra)
                node.pop("patternProperties", None)

    @staticmethod
    def _unique_items(node: dict[str, Any], at: str) -> None:
        if node.pop("uniqueItems", False) is not True:
            return
        if node.get("maxItems", 2) <= 1:
            return
        if node.get("minItems", 0) > 1:
            raise Unsupported("uniqueItems", f"{at}/uniqueItems", "unique items cannot be enforced beyond one item")
        node["maxItems"] = 1  # narrowing: an array of at most one item is unique

    @staticmethod
    def _contains(node: dict[str, Any], at: str) -> None:
        if "contains" not in node:
            node.pop("minContains", None)
            node.pop("maxContains", None)
            return
        wanted = node.pop("contains")
        least = node.pop("minContains", 1)
        if "maxContains" in node:
            raise Unsupported("maxContains", f"{at}/maxContains", "an upper bound on matching items is not enforced")
        if least == 0:
            return
        prefix = list(node.get("prefixItems", []))
        rest = node.get("items", True)
        for i in range(least):  # narrowing: the first items are the ones that match
            slot = prefix[i] if i < len(prefix) else rest
            merged = wanted if slot is True else {"allOf": [slot, wanted]}
            if i < len(prefix):
                prefix[i] = merged
            else:
                prefix.append(merged)
        node["prefixItems"] = prefix
        node["minItems"] = max(node.get("minItems", 0), least)

    def _property_names(self, node: dict[str, Any], at: str) -> None:
        if "propertyNames" not in node:
            return
        names = node.pop("propertyNames")
        if names is True:
            return
        props = node.get("properties", {})
        for key in node.get("required", []):
            if not self._valid(key, names):
                raise Unsupported("propertyNames", f"{at}/propertyNames", f"the required key {key!r} breaks it")
        node["properties"] = {k: (v if self._valid(k, names) else False) for k, v in props.items()}
        if node.get("additionalProperties", True) is False or node.get("patternProperties"):
            node["additionalProperties"] = False  # the others: each pattern's keys must match, checked below
            for pattern in node.get("patternProperties", {}):
                if not (isinstance(names, dict) and names.get("pattern") == pattern):
                    raise Unsupported(
                        "propertyNames", f"{at}/propertyNames", "it cannot be combined with patternProperties"
                    )
            return
        pattern = _name_pattern(names)
        if pattern is None:
            raise Unsupported(
                "propertyNames", f"{at}/propertyNames", "only pattern, enum, const and length bounds are enforced"
            )
        node["patternProperties"] = {pattern: node.pop("additionalProperties", True)}
        node["additionalProperties"] = False

    # -- values: enum and const nodes are filtered exactly ----------------------------------------

    def _filter_values(self, node: dict[str, Any], keep: Callable[[Any], bool]) -> bool:
        """If ``node`` lists its values (enum/const), keep those ``keep`` accepts; True when done so."""
        if "const" in node:
            if not keep(node["const"]):
                node["enum"] = []  # no value is left: unsatisfiable, and the compiler says so
                del node["const"]
            return True
        if isinstance(node.get("enum"), list):
            node["enum"] = [v for v in node["enum"] if keep(v)]
            return True
        return False

    def _valid(self, value: Any, schema: Schema) -> bool:
        """Whether ``value`` is valid against ``schema`` (a part of the original), by JSON Schema itself."""
        key = json.dumps(schema, sort_keys=True)
        check = self._validators.get(key)
        if check is None:
            check = self._validators[key] = _validator(self.root, schema)
        return check(value)

    # -- analysis: what a schema surely requires, and negation ------------------------------------

    def resolve(self, schema: Schema, depth: int) -> Schema:
        while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and len(schema) == 1:
            if depth > MAX_DEPTH:
                return True
            schema = _pointer(self.root, schema["$ref"])
            depth += 1
        return schema

    def facts(self, schema: Schema, depth: int) -> _Facts:
        """What every instance of ``schema`` surely has (types, values, required keys, key schemas)."""
        schema = self.resolve(schema, depth)
        facts = _Facts()
        if schema is False:
            facts.types = frozenset()
            return facts
        if not isinstance(schema, dict) or depth > MAX_DEPTH:
            return facts
        if "type" in schema:
            named = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            facts.types = frozenset(t for t in named if t in ALL_TYPES)
        if "const" in schema:
            facts.values = [schema["const"]]
        elif isinstance(schema.get("enum"), list):
            facts.values = list(schema["enum"])
        facts.required = set(schema.get("required", []))
        facts.properties = {k: [v] for k, v in schema.get("properties", {}).items()}
        facts.closed = schema.get("additionalProperties", True) is False and not schema.get("patternProperties")
        parts = list(schema.get("allOf", []))
        if isinstance(schema.get("$ref"), str):
            parts.append({"$ref": schema["$ref"]})
        for part in parts:
            facts.merge(self.facts(part, depth + 1))
        return facts

    def disjoint(self, a: Schema, b: Schema, depth: int) -> bool:
        """True only when no instance is valid against both ``a`` and ``b``."""
        fa, fb = self.facts(a, depth), self.facts(b, depth)
        if fa.types is not None and fb.types is not None and not (_widen(fa.types) & _widen(fb.types)):
            return True
        if fa.values is not None and not any(self._valid(v, b) for v in fa.values):
            return True
        if fb.values is not None and not any(self._valid(v, a) for v in fb.values):
            return True
        # both must be objects for the key-based proofs (a non-object would satisfy both)
        objects = {"object"}
        if not (fa.types is not None and fa.types <= objects or fb.types is not None and fb.types <= objects):
            return False
        for key in fa.required & fb.required:
            if any(
                self.disjoint(x, y, depth + 1) for x in fa.properties.get(key, []) for y in fb.properties.get(key, [])
            ):
                return True
        for mine, theirs in ((fa, fb), (fb, fa)):
            for key in mine.required:
                if False in theirs.properties.get(key, []) or (theirs.closed and key not in theirs.properties):
                    return True
        return False

    def negate(self, schema: Schema, depth: int) -> Schema | None:
        """A schema accepting only instances ``schema`` refuses (None when it cannot be written)."""
        schema = self.resolve(schema, depth)
        if depth > MAX_DEPTH:
            return None
        if schema is True or schema == {}:
            return {"enum": []}
        if schema is False:
            return True
        if not isinstance(schema, dict):
            return None
        alternatives: list[Schema] = []
        for key, value in schema.items():
            if key in ANNOTATIONS or key.startswith("x-") or key in ("required", "properties") and not value:
                continue
            negated = self._negate_keyword(key, value, schema, depth)
            if negated is None:
                return None
            alternatives.extend(negated)
        if not alternatives:
            return {"enum": []}  # only annotations: everything is valid, so nothing is in the negation
        return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}

    def _negate_keyword(self, key: str, value: Any, schema: dict[str, Any], depth: int) -> list[Schema] | None:
        """The instances that fail ``key`` (as alternatives), or None."""
        bound = _NEGATED_BOUNDS.get(key)
        if bound is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
            flipped, shift = bound
            result = value + shift
            if shift and result < 0:
                return [{"enum": []}]
            applies = _BOUND_TYPES[key]
            return [{"type": applies, flipped: result}, {"type": [t for t in TYPES if t not in applies]}]
        if key == "type":
            named = set(value if isinstance(value, list) else [value])
            if "number" in named:
                named.add("integer")
            others = [t for t in TYPES if t not in _widen(frozenset(named))]
            if "integer" in named and "number" not in named:
                pass  # non-integer numbers cannot be told apart: left out (narrowing)
            return [{"type": others}] if others else [{"enum": []}]
        if key in ("const", "enum"):
            values = [value] if key == "const" else value
            return _complement_of_values(values)
        if key == "required":
            return [{"properties": {k: False}} for k in value]
        if key == "properties":
            out = []
            for name, sub in value.items():
                negated = self.negate(sub, depth + 1)
                if negated is None:
                    return None
                out.append({"type": "object", "required": [name], "properties": {name: negated}})
            return out
        if key == "anyOf":
            parts = [self.negate(s, depth + 1) for s in value]
            return None if any(p is None for p in parts) else [{"allOf": parts}]
        if key == "allOf":
            parts = [self.negate(s, depth + 1) for s in value]
            return None if any(p is None for p in parts) else parts
        if key == "not":
            return [value]
        if key == "$ref":
            negated = self.negate({"$ref": value}, depth + 1)
            return None if negated is None else [negated]
        return None


_NEGATED_BOUNDS: dict[str, tuple[str, int | float]] = {
    "minimum": ("exclusiveMaximum", 0),
    "maximum": ("exclusiveMinimum", 0),
    "exclusiveMinimum": ("maximum", 0),
    "exclusiveMaximum": ("minimum", 0),
    "minLength": ("maxLength", -1),
    "maxLength": ("minLength", 1),
    "minItems": ("maxItems", -1),
    "maxItems": ("minItems", 1),
}
_BOUND_TYPES = {
    "minimum": ["number"],
    "maximum": ["number"],
    "exclusiveMinimum": ["number"],
    "exclusiveMaximum": ["number"],
    "minLength": ["string"],
    "maxLength": ["string"],
    "minItems": ["array"],
    "maxItems": ["array"],
}


class _Facts:
    """What every instance of a schema surely has; None: unknown (anything)."""

    def __init__(self) -> None:
        self.types: frozenset[str] | None = None
        self.values: list[Any] | None = None
        self.required: set[str] = set()
        self.properties: dict[str, list[Schema]] = {}
        self.closed = False

    def merge(self, other: _Facts) -> None:
        """Both hold (allOf)."""
        if other.types is not None:
            self.types = other.types if self.types is None else _meet(self.types, other.types)
        if other.values is not None and self.values is None:
            self.values = other.values
        self.required |= other.required
        for key, schemas in other.properties.items():
            self.properties.setdefault(key, []).extend(schemas)


def _widen(types: frozenset[str]) -> frozenset[str]:
    """Type names with "integer" read as a part of "number" (for overlap tests)."""
    return frozenset("number" if t == "integer" else t for t in types)


def _meet(a: frozenset[str], b: frozenset[str]) -> frozenset[str]:
    out = set(a & b)
    if "integer" in a and "number" in b or "number" in a and "integer" in b:
        out.add("integer")
    return frozenset(out)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _complement_of_values(values: list[Any]) -> list[Schema] | None:
    """Every instance but ``values``: the other types whole, and the complement within each type listed.
    Objects and arrays among the values take their type out whole (narrowing)."""
    by_kind: dict[str, list[Any]] = {}
    for v in values:
        by_kind.setdefault(_kind(v), []).append(v)
    out: list[Schema] = []
    untouched = [t for t in TYPES if t not in by_kind]
    if untouched:
        out.append({"type": untouched})
    if "boolean" in by_kind:
        rest = [b for b in (True, False) if b not in by_kind["boolean"]]
        if rest:
            out.append({"const": rest[0]})
    if "number" in by_kind:
        points = sorted(set(by_kind["number"]))  # ints stay ints: a float of a huge int could pass it
        out.append({"type": "number", "exclusiveMaximum": _num(points[0])})
        out.extend(
            {"type": "number", "exclusiveMinimum": _num(lo), "exclusiveMaximum": _num(hi)}
            for lo, hi in zip(points, points[1:])
        )
        out.append({"type": "number", "exclusiveMinimum": _num(points[-1])})
    if "string" in by_kind:
        strings = sorted(set(by_kind["string"]))
        if sum(len(s) for s in strings) > MAX_COMPLEMENT_CHARS:
            return None
        out.append({"type": "string", "pattern": "^" + _not_these(strings) + "$"})
    return out if len(out) <= MAX_BRANCHES else None


def _num(value: int | float) -> int | float:
    return int(value) if isinstance(value, float) and value.is_integer() else value


_ANY = r"[\s\S]"


def _not_these(strings: list[str]) -> str:
    """A regex (no lookaround) for every string but ``strings``, from their trie."""
    trie: dict[str, Any] = {}
    for s in strings:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}  # the end of a listed string

    def walk(node: dict[str, Any]) -> str:
        chars = sorted(c for c in node if c)
        alternatives = [] if "" in node else [""]  # stopping here is another string unless one ends here
        if chars:
            alternatives.append("[^" + "".join(_class_char(c) for c in chars) + "]" + _ANY + "*")
        else:
            alternatives.append(_ANY + "+")
        alternatives.extend(_literal(c) + "(?:" + walk(node[c]) + ")" for c in chars)
        return "|".join(alternatives)

    return "(?:" + walk(trie) + ")"


def _literal(text: str) -> str:
    """``text`` as a regex matching itself (only the metacharacters escaped: llguidance's regex syntax is
    Rust's, which refuses some escapes Python's re.escape writes)."""
    return "".join("\\" + ch if ch in _META else ch for ch in text)


_META = frozenset("\\.^$|?*+()[]{}")


def _class_char(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-[" else ch


def _choices(keys: list[str], need: int) -> Iterator[tuple[str, ...]]:
    """Every choice of ``need`` keys (in order), stopping past MAX_BRANCHES."""
    import itertools

    for count, choice in enumerate(itertools.combinations(keys, need)):
        if count > MAX_BRANCHES:
            return
        yield choice


def _name_pattern(names: Schema) -> str | None:
    """A regex for the keys ``propertyNames`` allows (None: it says more than this can carry)."""
    if not isinstance(names, dict):
        return None
    keys = set(names) - ANNOTATIONS - {"type"}
    if names.get("type", "string") != "string":
        return None
    if keys == {"pattern"}:
        return str(names["pattern"])
    if keys <= {"minLength", "maxLength"}:
        return "^" + _ANY + "{" + f"{names.get('minLength', 0)},{names.get('maxLength', '')}" + "}$"
    if keys in ({"enum"}, {"const"}):
        values = names["enum"] if "enum" in names else [names["const"]]
        return "^(?:" + "|".join(_literal(v) for v in values if isinstance(v, str)) + ")$"
    return None


def _add_all(node: dict[str, Any], schema: Schema) -> None:
    """``node`` and ``schema`` both hold (appended to its allOf)."""
    node["allOf"] = [*node.get("allOf", []), schema]


def _pointer(root: Any, ref: str) -> Schema:
    """The part of ``root`` a local ``$ref`` (``#/a/b``) names; True (anything) where it names nothing."""
    if not ref.startswith("#"):
        return True
    node = root
    for token in [t for t in ref[1:].split("/") if t]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return True
    return node


def _validator(root: dict[str, Any], schema: Schema) -> Callable[[Any], bool]:
    """Whether a value is valid against ``schema`` (a part of ``root``, whose definitions its $refs name),
    by the draft ``root``'s ``$schema`` names (2020-12 by default)."""
    import jsonschema  # type: ignore[import-untyped]

    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    validator = cls(root).evolve(schema=schema)
    return lambda value: bool(validator.is_valid(value))
