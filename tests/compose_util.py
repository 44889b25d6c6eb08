"""Read a docker compose file the way `docker compose up` would start it, without docker.

`compose_commands` answers: which processes does this file start, in which order, with which argv and
environment? Tests use it to check the compose file against the Dockerfile, and to start the same commands
as local processes (then drive them with docker/loadtest.sh).

What it models, from the compose specification and the Dockerfile reference:
- interpolation of every string value: `$$`, `$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR-default}`,
  `${VAR:?message}`, `${VAR?message}`, `${VAR:+other}`, `${VAR+other}`, nested in defaults;
- argv = entrypoint + command. A service's `entrypoint` replaces the image's ENTRYPOINT and drops the image's
  CMD; its `command` replaces CMD. A string is split like a shell word list. The image's values come from
  the build stage named by `build.target` (default: the last stage) of the service's Dockerfile;
- environment in map or list form; an entry without a value is passed through from `env` when set there
  and left out otherwise. The image's ENV is not included (it sets PATH and other container-only values);
- start order: dependencies first (`depends_on`, list or map form), file order among independent services;
- profiles: a service that names profiles starts only when one of them is active.

Not modelled: `extends`, `include`, `env_file`, several compose files merged together.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import yaml

__all__ = [
    "ComposeError",
    "ServiceCommand",
    "compose_commands",
    "dockerfile_command",
    "dockerfile_instructions",
    "interpolate",
    "load_compose",
]


class ComposeError(ValueError):
    """The compose file or Dockerfile cannot be resolved (missing variable, cycle, unknown service...)."""


class ServiceCommand(NamedTuple):
    """One service as it would start: a tuple `(service, argv, environment)`."""

    service: str
    argv: list[str]
    environment: dict[str, str]


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Substitute compose variables in `text` from `env`.

    Raises:
        ComposeError: a `${VAR:?message}`/`${VAR?message}` variable is missing, or the syntax is invalid.
    """
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "$":
            out.append(char)
            i += 1
            continue
        nxt = text[i + 1 : i + 2]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "{":
            end = _closing_brace(text, i + 2)
            out.append(_expand_braced(text[i + 2 : end], env))
            i = end + 1
        else:
            match = _NAME.match(text, i + 1)
            if match is None:  # a lone "$" stays as it is
                out.append("$")
                i += 1
            else:
                out.append(env.get(match.group(), ""))
                i = match.end()
    return "".join(out)


def _closing_brace(text: str, start: int) -> int:
    depth = 1
    for j in range(start, len(text)):
        if text[j] == "{" and text[j - 1] == "$":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    raise ComposeError(f"unterminated ${{...}} in {text!r}")


def _expand_braced(expr: str, env: Mapping[str, str]) -> str:
    match = _NAME.match(expr)
    if match is None:
        raise ComposeError(f"invalid variable name in ${{{expr}}}")
    name, rest = match.group(), expr[match.end() :]
    value = env.get(name)
    if rest == "":
        return value or ""
    for op in (":-", ":?", ":+", "-", "?", "+"):
        if rest.startswith(op):
            word = rest[len(op) :]
            break
    else:
        raise ComposeError(f"invalid modifier in ${{{expr}}}")
    # With a colon the test is "unset or empty", without it "unset".
    present = bool(value) if op.startswith(":") else value is not None
    if op.endswith("-"):
        return value if present and value is not None else interpolate(word, env)
    if op.endswith("+"):
        return interpolate(word, env) if present else ""
    if not present:
        raise ComposeError(f"required variable {name} is missing: {interpolate(word, env)}")
    return value or ""


def _interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    """Interpolate every string value (not the keys), as compose does."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_tree(value, env) for key, value in node.items()}
    return node


def load_compose(compose_path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> dict:
    """The compose file as a dict: YAML anchors and merge keys resolved, then interpolated from `env`."""
    with open(compose_path, encoding="utf-8") as file:
        document = yaml.safe_load(file)
    if not isinstance(document, dict):
        raise ComposeError(f"{compose_path} is not a YAML mapping")
    return _interpolate_tree(document, env or {})


def dockerfile_command(dockerfile: str | os.PathLike[str], target: str | None = None) -> tuple[list[str], list[str]]:
    """The (ENTRYPOINT, CMD) of stage `target` (default: the last stage) of a Dockerfile.

    Both must be in exec (JSON) form; a stage inherits them from a stage it is built `FROM`.
    """
    stages: dict[str, tuple[list[str], list[str]]] = {}
    current: tuple[list[str], list[str]] | None = None
    current_name = ""
    for instruction, argument in dockerfile_instructions(Path(dockerfile).read_text(encoding="utf-8")):
        if instruction == "FROM":
            if current is not None:
                stages[current_name] = current
            words = [word for word in argument.split() if not word.startswith("--")]  # drop --platform=
            base = words[0].lower()
            current_name = words[2].lower() if len(words) >= 3 and words[1].lower() == "as" else str(len(stages))
            current = stages.get(base, ([], []))
        elif current is not None and instruction in ("ENTRYPOINT", "CMD"):
            try:
                value = json.loads(argument)
            except json.JSONDecodeError:
                raise ComposeError(f"{instruction} must be in exec (JSON) form: {argument}") from None
            if instruction == "ENTRYPOINT":
                current = (value, [])  # setting ENTRYPOINT resets an inherited CMD
            else:
                current = (current[0], value)
    if current is None:
        raise ComposeError(f"{dockerfile} has no FROM")
    stages[current_name] = current
    if target is None:
        return current
    try:
        return stages[target.lower()]
    except KeyError:
        raise ComposeError(f"{dockerfile} has no stage {target!r}") from None


def dockerfile_instructions(text: str) -> Iterable[tuple[str, str]]:
    """(INSTRUCTION, argument) pairs, with comments dropped and backslash continuations joined."""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            instruction, _, argument = line.partition(" ")
            yield instruction.upper(), argument.strip()


def compose_commands(
    compose_path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    *,
    profiles: Iterable[str] = (),
) -> list[ServiceCommand]:
    """Each service's (service, argv, environment), in start order.

    `env` plays the part of the shell environment and the .env file (nothing is read from os.environ).

    Raises:
        ComposeError: a required variable is missing, a dependency is unknown or cyclic, or a service has
            no command at all.
    """
    env = dict(env or {})
    compose_path = Path(compose_path)
    document = load_compose(compose_path, env)
    services: dict[str, dict] = document.get("services") or {}
    active = set(profiles)
    selected = [name for name, spec in services.items() if not spec.get("profiles") or active & set(spec["profiles"])]
    result = []
    for name in _start_order(services, selected):
        spec = services[name]
        entrypoint, cmd = _image_command(compose_path.parent, services, name)
        if "entrypoint" in spec:
            entrypoint, cmd = _argv(spec["entrypoint"]), []
        if "command" in spec:
            cmd = _argv(spec["command"])
        argv = entrypoint + cmd
        if not argv:
            raise ComposeError(f"service {name!r} has no entrypoint and no command")
        result.append(ServiceCommand(name, argv, _environment(spec.get("environment"), env)))
    return result


def _argv(value: str | list | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(item) for item in value]


def _environment(value: Mapping | list | None, env: Mapping[str, str]) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, list):
        pairs: list[tuple[str, Any]] = []
        for item in value:
            key, sep, val = str(item).partition("=")
            pairs.append((key, val if sep else None))
    else:
        pairs = list(value.items())
    resolved = {}
    for key, val in pairs:
        if val is None:
            if key in env:
                resolved[key] = env[key]
        elif isinstance(val, bool):
            resolved[key] = "true" if val else "false"
        else:
            resolved[key] = str(val)
    return resolved


def _image_command(base_dir: Path, services: Mapping[str, dict], name: str) -> tuple[list[str], list[str]]:
    """ENTRYPOINT and CMD of the image the service runs: its own build, or the build of a service that
    produces the same image tag. Without any build the image's defaults are unknown: ([], [])."""
    spec = services[name]
    build = spec.get("build")
    if build is None and "image" in spec:
        build = next(
            (
                other["build"]
                for other in services.values()
                if other.get("image") == spec["image"] and other.get("build")
            ),
            None,
        )
    if build is None:
        return [], []
    if isinstance(build, str):
        build = {"context": build}
    context = base_dir / build.get("context", ".")
    dockerfile = context / build.get("dockerfile", "Dockerfile")
    return dockerfile_command(dockerfile, build.get("target"))


def _start_order(services: Mapping[str, dict], selected: list[str]) -> list[str]:
    """Depth-first topological order: each service after its dependencies, otherwise file order."""
    order: list[str] = []
    state: dict[str, str] = {}  # "visiting" while on the current path, "done" once placed

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ComposeError("depends_on cycle: " + " -> ".join(path + (name,)))
        if name not in services:
            raise ComposeError(f"service {path[-1]!r} depends on unknown service {name!r}")
        state[name] = "visiting"
        for dependency in _dependencies(services[name]):
            visit(dependency, path + (name,))
        state[name] = "done"
        order.append(name)

    for name in selected:
        visit(name, ())
    return order


def _dependencies(spec: Mapping) -> list[str]:
    depends_on = spec.get("depends_on") or []
    return list(depends_on) if isinstance(depends_on, (list, dict)) else []
