"""A task's ``environment/docker-compose.yaml`` on the local sandbox: each service a sandbox of its own.

What it reads of the file (typed models, :func:`load_compose`), what it refuses (:func:`compose_problems`:
by file, service, field and fix), and the services at run time (:class:`ComposeGroup`).

How services are placed. Every service is a box of its own (its image's root under its own overlay, its
own user, PID, mount, IPC and UTS namespaces, its own supervisor), which joins the network namespace of
the task's ``main`` box (``BoxConfig.netns_of``) instead of making its own: the task's sandboxes share
one loopback, as Harbor's Docker backend has them share one network namespace (its egress sidecar's)
whenever a phase limits the network. A service's name (and ``main``) resolves to ``127.0.0.1`` through
``/etc/hosts`` in every sandbox of the task, so ``http://server:8000`` reaches the service's port as under
Docker. The network follows ``main``'s phases (loopback only, or the user-mode stack attached to the shared
namespace), and the verifier's view, which mirrors ``main``'s listeners on its own loopback, reaches the
services by the same names and ports (its ``/etc/hosts`` keeps the agent's local names). Two services
cannot listen on one port; where the file declares ports (``ports``, ``expose``), that is refused here.

Named volumes are folders on a bounded tmpfs of the task's own, mounted by the host on each tree that
uses them before its box starts (they go with the tree's lazy detach at stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import shlex
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from harbor_local_sandbox import _hostfs
from harbor_local_sandbox._binaries import SYSTEM_PATH, which
from harbor_local_sandbox._lifetime import new_box_name, state_root
from harbor_local_sandbox._mounts import _libc, inode_bound, mount_bounded_tmpfs, unmount
from harbor_local_sandbox._roots import DOCKER_HOSTS, ImageRoot, RootTask
from harbor_local_sandbox.errors import (
    ComposeUnsupportedError,
    SandboxError,
    ServiceError,
    ServiceUnhealthyError,
)

logger = logging.getLogger(__name__)

COMPOSE_FILE = "docker-compose.yaml"
MAIN = "main"
MiB = 1 << 20
#: Where a service's standard output and error go in its own tree (copied to the trial folder at stop).
SERVICE_OUTPUT = "/.harbor-local-sandbox-output"
#: How much of a service's output an error quotes.
OUTPUT_TAIL = 2000
#: The folder of the trial's that keeps each service's output (``<trial>/services/<name>.log``).
SERVICES_LOG_DIR = "services"
#: Docker's healthcheck defaults (seconds).
_INTERVAL, _TIMEOUT, _RETRIES = 30.0, 30.0, 3

#: Keys a service may have that change nothing here (Docker's restart policy, names and labels, TTYs, logging).
IGNORED_KEYS = frozenset(
    {"restart", "labels", "container_name", "stdin_open", "tty", "stop_signal", "stop_grace_period", "logging",
     "pull_policy", "init"}
)  # fmt: skip
#: Keys of a service the local sandbox runs.
SERVICE_KEYS = frozenset(
    {"build", "image", "command", "entrypoint", "environment", "working_dir", "user", "depends_on", "healthcheck",
     "volumes", "ports", "expose"}
)  # fmt: skip
#: What ``main`` (the agent's sandbox, made of ``environment/Dockerfile`` and ``task.toml``) may set here.
MAIN_KEYS = frozenset({"depends_on", "environment", "volumes", "ports", "expose", "build", "image"})
#: Keys refused, with why and the fix.
REFUSED: dict[str, str] = {
    "privileged": "no sandbox runs privileged (Docker's default capabilities only). Fix: remove it",
    "cap_add": "a sandbox has Docker's default capabilities, no more. Fix: remove it",
    "cap_drop": "a sandbox has Docker's default capabilities, no fewer. Fix: remove it",
    "devices": "no host device reaches a sandbox. Fix: remove it",
    "network_mode": "a task's services share one network namespace with `main` (one loopback); the task's "
    "[environment] network_mode in task.toml says whether it reaches the internet. Fix: remove it",
    "networks": "a task's services share one network namespace with `main` (one loopback), reached by "
    "service name. Fix: remove it",
    "security_opt": "sandboxes have no seccomp or LSM profiles to choose. Fix: remove it",
    "pid": "each service has a PID namespace of its own. Fix: remove it",
    "ipc": "each service has an IPC namespace of its own. Fix: remove it",
    "userns_mode": "each service has a user namespace of its own. Fix: remove it",
    "sysctls": "sysctls cannot be set per service. Fix: remove it",
    "extra_hosts": "`/etc/hosts` holds the service names (all on 127.0.0.1). Fix: remove it",
    "dns": "services resolve each other by `/etc/hosts`. Fix: remove it",
    "dns_search": "services resolve each other by `/etc/hosts`. Fix: remove it",
    "links": "every service reaches every other by name. Fix: remove it",
    "external_links": "nothing outside the task is reached. Fix: remove it",
    "env_file": "environment files are not read. Fix: list the variables under `environment`",
    "configs": "configs are not mounted. Fix: COPY the file in the service's Dockerfile",
    "secrets": "secrets are not mounted. Fix: COPY the file in the service's Dockerfile",
    "tmpfs": "tmpfs mounts are not made. Fix: remove it (a service's tree is on a tmpfs already)",
    "volumes_from": "volumes are shared by name only. Fix: mount the named volume in both services",
    "extends": "`extends` is not resolved. Fix: write the service out in full",
    "profiles": "profiles are not selected. Fix: remove it (every service runs)",
    "deploy": "per-service resources are not set (each service gets the task's default limits). Fix: remove it",
    "gpus": "no GPU reaches a sandbox. Fix: remove it",
    "runtime": "there is no container runtime to choose. Fix: remove it",
    "cgroup_parent": "each sandbox has cgroups of its own. Fix: remove it",
    "ulimits": "per-service rlimits are not set. Fix: remove it",
    "shm_size": "`/dev/shm` is 64 MB in every sandbox. Fix: remove it",
    "platform": "images run for this machine's architecture only. Fix: remove it",
    "hostname": "a service's host name is its service name. Fix: remove it",
    "domainname": "a service's host name is its service name. Fix: remove it",
    "read_only": "a service's root is its own copy-on-write tree. Fix: remove it",
    "mem_limit": "per-service limits are not set (each service gets the task's default limits). Fix: remove it",
    "cpus": "per-service limits are not set (each service gets the task's default limits). Fix: remove it",
    "scale": "one sandbox per service. Fix: remove it",
}
#: Top-level keys the file may have; the rest are refused (``x-`` extensions are ignored).
TOP_KEYS = frozenset({"services", "volumes", "name", "version"})
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
#: A variable of compose's interpolation (``$$`` is a literal ``$``).
_VARIABLE = re.compile(r"\$(?:\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def _unescape(value: Any, where: str, problems: list[str]) -> Any:
    """``value`` with compose's ``$$`` made ``$``; a variable to interpolate (``${NAME}``, ``$NAME``) is refused:
    the file is read as it is, not with the host's environment."""
    if isinstance(value, dict):
        return {k: _unescape(v, where, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_unescape(v, where, problems) for v in value]
    if isinstance(value, str) and "$" in value:
        for found in _VARIABLE.findall(value.replace("$$", "")):
            problems.append(
                f"{where}: {found} in {value!r}: variables are not interpolated here (the file is read as written). "
                "Fix: write the value, or $$ for a literal $"
            )
        return value.replace("$$", "$")
    return value


def duration(value: Any) -> float:
    """A compose duration (``"1m30s"``, ``"500ms"``, ``10``: seconds) in seconds."""
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    parts = _DURATION.findall(text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise ValueError(f"{value!r} is not a duration (e.g. 10s, 1m30s, 500ms)")
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(number) * scale[unit] for number, unit in parts)


class Healthcheck(BaseModel):
    """A service's ``healthcheck`` (Docker's fields and defaults)."""

    model_config = ConfigDict(extra="forbid")

    test: list[str] | str | None = None
    interval: float = _INTERVAL
    timeout: float = _TIMEOUT
    retries: int = Field(default=_RETRIES, ge=0)
    start_period: float = 0.0
    start_interval: float = 5.0
    disable: bool = False

    @field_validator("interval", "timeout", "start_period", "start_interval", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float:
        return duration(value)

    @property
    def command(self) -> str | None:
        """The probe as a shell command (``None``: no probe: ``NONE`` or ``disable``)."""
        test = self.test
        if self.disable or test is None or test == ["NONE"]:
            return None
        if isinstance(test, str):
            return f"exec /bin/sh -c {shlex.quote(test)}"
        if test[:1] == ["CMD-SHELL"] and len(test) == 2:
            return f"exec /bin/sh -c {shlex.quote(test[1])}"
        if test[:1] == ["CMD"] and len(test) > 1:
            return "exec " + shlex.join(test[1:])
        raise ValueError(f"healthcheck test {test!r}: use [CMD, ...], [CMD-SHELL, command], a string or [NONE]")


class Dependency(BaseModel):
    """One ``depends_on`` entry."""

    model_config = ConfigDict(extra="forbid")

    condition: Literal["service_started", "service_healthy", "service_completed_successfully"] = "service_started"
    restart: bool = False
    required: bool = True


class Build(BaseModel):
    """A service's ``build``: its context (a folder beside the file) and its Dockerfile's name."""

    model_config = ConfigDict(extra="forbid")

    context: str = "."
    dockerfile: str = "Dockerfile"


class VolumeMount(BaseModel):
    """A named volume mounted in a service (``name:/path[:ro]`` or the long form)."""

    source: str
    target: str
    read_only: bool = False


class Service(BaseModel):
    """A service as the local sandbox runs it (what :func:`compose_problems` let through)."""

    model_config = ConfigDict(extra="ignore")

    name: str
    build: Build | None = None
    image: str | None = None
    command: list[str] | None = None
    entrypoint: list[str] | None = None
    environment: dict[str, str] = Field(default_factory=dict)
    working_dir: str | None = None
    user: str | None = None
    depends_on: dict[str, Dependency] = Field(default_factory=dict)
    healthcheck: Healthcheck | None = None
    volumes: list[VolumeMount] = Field(default_factory=list)
    ports: list[int] = Field(default_factory=list)

    @field_validator("build", mode="before")
    @classmethod
    def _build(cls, value: Any) -> Any:
        return {"context": value} if isinstance(value, str) else value

    @field_validator("command", "entrypoint", mode="before")
    @classmethod
    def _argv(cls, value: Any) -> Any:
        # As compose: a string is split as a shell would split it, not run by a shell.
        return shlex.split(value) if isinstance(value, str) else value

    @field_validator("environment", mode="before")
    @classmethod
    def _environment(cls, value: Any) -> Any:
        if value is None:
            return {}
        if isinstance(value, list):
            pairs = [str(item).split("=", 1) for item in value]
            return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}  # `NAME` alone: the host's, not passed
        return {
            str(k): "" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()
        }

    @field_validator("depends_on", mode="before")
    @classmethod
    def _depends_on(cls, value: Any) -> Any:
        if value is None:
            return {}
        if isinstance(value, list):
            return {str(name): {} for name in value}
        return {str(name): spec or {} for name, spec in value.items()}

    @field_validator("volumes", mode="before")
    @classmethod
    def _volumes(cls, value: Any) -> Any:
        mounts = []
        for item in value or []:
            if isinstance(item, str):
                parts = item.split(":")
                mounts.append({"source": parts[0], "target": parts[1], "read_only": parts[2:3] == ["ro"]})
            else:
                mounts.append(
                    {"source": item["source"], "target": item["target"], "read_only": item.get("read_only", False)}
                )
        return mounts

    @property
    def command_line(self) -> tuple[list[str] | None, list[str] | None]:
        """``(entrypoint, command)`` as given (``None``: the image's)."""
        return self.entrypoint, self.command


@dataclass(frozen=True)
class ComposeProject:
    """What a task's compose file asks of the local sandbox: its services (``main`` aside), ``main``'s own
    additions (its environment, its volumes, what it waits for), and its named volumes."""

    path: Path
    services: dict[str, Service]
    main: Service
    volumes: tuple[str, ...]

    def order(self) -> list[str]:
        """The services in an order that starts each after what it depends on."""
        done: list[str] = []
        visiting: set[str] = set()

        def visit(name: str) -> None:
            if name in done or name == MAIN:
                return
            visiting.add(name)
            for dependency in self.services[name].depends_on:
                visit(dependency)
            visiting.discard(name)
            done.append(name)

        for name in self.services:
            visit(name)
        return done

    @property
    def hosts(self) -> str:
        """The ``/etc/hosts`` line naming every service of the task (``main`` too) on the shared loopback."""
        return "127.0.0.1\t" + " ".join([MAIN, *self.services]) + "\n"


def _port_numbers(value: Any, field: str, where: str, problems: list[str]) -> list[int]:
    """The ports a service listens on, from ``ports`` (its container side) or ``expose``."""
    found = []
    for item in value or []:
        text = str(item.get("target", "")) if isinstance(item, dict) else str(item)
        text = text.split("/", 1)[0].rsplit(":", 1)[-1]
        low, _, high = text.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            problems.append(f"{where}: `{field}` entry {item!r} is not a port. Fix: write it as PORT or HOST:PORT")
            continue
        found += range(int(low), int(high or low) + 1)
    return found


def _volume_problems(value: Any, where: str, declared: set[str], problems: list[str]) -> None:
    for item in value or []:
        if isinstance(item, str):
            parts = item.split(":")
            source = parts[0] if len(parts) >= 2 else ""
            if len(parts) < 2 or len(parts) > 3 or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
                problems.append(
                    f"{where}: `volumes` entry {item!r}: only named volumes are mounted (NAME:/path[:ro]); an "
                    "anonymous volume is not. Fix: name it under the top-level `volumes` and mount it as NAME:/path"
                )
                continue
            target = parts[1]
        elif isinstance(item, dict):
            if item.get("type", "volume") != "volume":
                problems.append(
                    f"{where}: `volumes` entry of type {item.get('type')!r}: only named volumes are mounted "
                    "(no host path, no tmpfs reaches a sandbox). Fix: a named volume, or COPY the files in the "
                    "service's Dockerfile"
                )
                continue
            unknown = set(item) - {"type", "source", "target", "read_only"}
            if unknown:
                problems.append(
                    f"{where}: `volumes` entry field(s) {sorted(unknown)} are not supported. Fix: remove them"
                )
            source, target = str(item.get("source", "")), str(item.get("target", ""))
        else:
            problems.append(f"{where}: `volumes` entry {item!r} is not a volume")
            continue
        if source.startswith((".", "/", "~", "$")) or "/" in source:
            problems.append(
                f"{where}: `volumes` entry {source}:{target}: a bind mount of a host path; no host folder reaches a "
                "sandbox. Fix: a named volume (declared under the top-level `volumes`), or COPY the files in the "
                "service's Dockerfile"
            )
        elif source not in declared:
            problems.append(
                f"{where}: `volumes` entry {source}:{target}: the volume {source!r} is not declared under the "
                "top-level `volumes`. Fix: declare it"
            )
        elif not target.startswith("/"):
            problems.append(f"{where}: `volumes` entry {source}:{target}: the target must be an absolute path")


def compose_problems(environment_dir: Path | str) -> list[str]:
    """What in the task's ``environment/docker-compose.yaml`` the local sandbox does not run, one line per
    field, each with the file, the service, the field and the fix (empty: it runs as written, or there is no file)."""
    path = Path(environment_dir) / COMPOSE_FILE
    if not path.is_file():
        return []
    where_file = str(path)
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        return [f"{where_file}: cannot be read as YAML ({error})"]
    if document is None:
        return []
    if not isinstance(document, dict):
        return [f"{where_file}: not a compose file (a mapping with `services`)"]
    problems: list[str] = []
    document = _unescape(document, where_file, problems)
    for key in document:
        if str(key).startswith("x-") or key in TOP_KEYS:
            continue
        problems.append(
            f"{where_file}: top-level `{key}` is not supported (services share one network with `main`; "
            "configs and secrets are not mounted; `include` is not resolved). Fix: remove it"
        )
    declared: set[str] = set()
    if not isinstance(document.get("volumes") or {}, dict):
        return [*problems, f"{where_file}: the top-level `volumes` is not a mapping of names"]
    for name, spec in (document.get("volumes") or {}).items():
        declared.add(str(name))
        extra = sorted(set(spec or {}) - {"name"}) if isinstance(spec, dict) else []
        if extra:
            problems.append(
                f"{where_file}: volume {name!r}: {', '.join(f'`{k}`' for k in extra)} not supported (volumes are "
                "folders of the task's own, made empty at start). Fix: remove them"
            )
    services = document.get("services") or {}
    if not isinstance(services, dict):
        return [*problems, f"{where_file}: `services` is not a mapping"]
    ports: dict[int, str] = {}
    for name, spec in services.items():
        where = f"{where_file}: service {name!r}"
        spec = spec or {}
        if not isinstance(spec, dict):
            problems.append(f"{where}: not a mapping")
            continue
        if not _NAME.match(str(name)):
            problems.append(f"{where}: the name is not a host name. Fix: letters, digits, `-`, `_`, `.`")
        allowed = MAIN_KEYS if name == MAIN else SERVICE_KEYS
        for key in spec:
            if key in IGNORED_KEYS or key in allowed or str(key).startswith("x-"):
                continue
            if name == MAIN and key in SERVICE_KEYS:
                problems.append(
                    f"{where}: `{key}`: `main` is the agent's sandbox, made of environment/Dockerfile and task.toml "
                    "(its [environment] workdir, its [agent] user). Fix: set it there"
                )
            else:
                why = REFUSED.get(str(key), "not supported by the local sandbox. Fix: remove it")
                problems.append(f"{where}: `{key}`: {why} (or run the task with environment_type='docker')")
        if name == MAIN:
            build = spec.get("build")
            if build is not None and build not in (".", "./") and not (
                isinstance(build, dict) and set(build) <= {"context", "dockerfile"}
                and build.get("context", ".") in (".", "./", "${CONTEXT_DIR}")
                and build.get("dockerfile", "Dockerfile") == "Dockerfile"
            ):  # fmt: skip
                problems.append(f"{where}: `build`: `main` is built from environment/Dockerfile. Fix: remove it")
        elif "build" in spec or "image" in spec:
            build = spec.get("build")
            if isinstance(build, dict):
                extra = sorted(set(build) - {"context", "dockerfile"})
                if extra:
                    problems.append(
                        f"{where}: `build` field(s) {', '.join(f'`{k}`' for k in extra)} not supported. Fix: "
                        "defaults in the Dockerfile's ARG lines"
                    )
                if build.get("dockerfile", "Dockerfile") != "Dockerfile":
                    problems.append(
                        f"{where}: `build.dockerfile` {build.get('dockerfile')!r}: a service's Dockerfile is its "
                        "context's `Dockerfile`. Fix: give the service a folder of its own with a file named Dockerfile"
                    )
                context = build.get("context", ".")
            else:
                context = build
            if context is not None:
                folder = (path.parent / str(context)).resolve()
                if not folder.is_relative_to(path.parent.resolve()) or str(context).startswith(
                    ("http:", "https:", "git")
                ):
                    problems.append(
                        f"{where}: `build` context {context!r} is outside environment/. "
                        "Fix: put it in a folder of environment/"
                    )
                elif not (folder / "Dockerfile").is_file():
                    problems.append(f"{where}: `build` context {context!r} has no Dockerfile")
        else:
            problems.append(f"{where}: neither `build` nor `image`. Fix: give it one")
        for dependency, condition in _dependencies(spec.get("depends_on"), where, problems):
            if dependency not in services and dependency != MAIN:
                problems.append(f"{where}: `depends_on` names {dependency!r}, which is not a service of the file")
            elif condition == "service_healthy":
                target = services.get(dependency) or {}
                check = target.get("healthcheck") if isinstance(target, dict) else None
                if not check or (
                    isinstance(check, dict) and (check.get("disable") or check.get("test") in (None, ["NONE"]))
                ):
                    problems.append(
                        f"{where}: `depends_on` {dependency!r} with `condition: service_healthy`, and {dependency!r} "
                        "has no `healthcheck` in the file (an image's HEALTHCHECK is not read). Fix: give it one"
                    )
            if dependency == MAIN and name != MAIN:
                problems.append(
                    f"{where}: `depends_on` `main`: `main` starts first here (its network is the services'), and "
                    "nothing waits for it. Fix: remove it"
                )
        _volume_problems(spec.get("volumes"), where, declared, problems)
        environment = spec.get("environment")
        unset = (
            [str(item) for item in environment if "=" not in str(item)]
            if isinstance(environment, list)
            else [str(k) for k, v in environment.items() if v is None]
            if isinstance(environment, dict)
            else []
        )
        for variable in unset:
            problems.append(
                f"{where}: `environment` {variable!r} without a value would take the host's, and the file is read "
                f"without the host's environment. Fix: {variable}=VALUE"
            )
        if name != MAIN:
            listened = _port_numbers(spec.get("ports"), "ports", where, problems)
            listened += _port_numbers(spec.get("expose"), "expose", where, problems)
            for port in sorted(set(listened)):
                if port in ports:
                    problems.append(
                        f"{where}: port {port} is also {ports[port]!r}'s: services share one loopback here (as "
                        "under Harbor whenever a phase limits the network), so two cannot listen on one port. "
                        "Fix: a port of its own for each"
                    )
                ports.setdefault(port, str(name))
        if "healthcheck" in spec:
            try:
                _ = Healthcheck.model_validate(spec["healthcheck"] or {}).command
            except (ValidationError, ValueError) as error:
                problems.append(f"{where}: `healthcheck`: {_first_error(error)}")
    if not problems:
        try:
            project = _project(path, document)
            project.order()
        except RecursionError:
            problems.append(f"{where_file}: `depends_on` has a cycle. Fix: break it")
        except (ValidationError, ValueError, KeyError, TypeError) as error:
            problems.append(f"{where_file}: {_first_error(error)}")
    return problems


def _dependencies(value: Any, where: str, problems: list[str]) -> list[tuple[str, str]]:
    if value is None:
        return []
    if isinstance(value, list):
        return [(str(name), "service_started") for name in value]
    if isinstance(value, dict):
        found = []
        for name, spec in value.items():
            try:
                found.append((str(name), Dependency.model_validate(spec or {}).condition))
            except ValidationError as error:
                problems.append(f"{where}: `depends_on` {name!r}: {_first_error(error)}")
        return found
    problems.append(f"{where}: `depends_on` is neither a list nor a mapping")
    return []


def _first_error(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        return f"{'.'.join(map(str, first['loc']))}: {first['msg']}"
    return str(error)


def _project(path: Path, document: dict) -> ComposeProject:
    services: dict[str, Service] = {}
    main = Service(name=MAIN)
    for name, spec in (document.get("services") or {}).items():
        spec = dict(spec or {})
        spec["ports"] = _port_numbers(spec.get("ports"), "ports", "", []) + _port_numbers(
            spec.get("expose"), "", "", []
        )
        service = Service.model_validate({**spec, "name": str(name)})
        if name == MAIN:
            main = service
        else:
            services[str(name)] = service
    volumes = tuple(str(name) for name in (document.get("volumes") or {}))
    return ComposeProject(path=path, services=services, main=main, volumes=volumes)


def load_compose(environment_dir: Path | str) -> ComposeProject | None:
    """The task's compose project (``None``: no ``docker-compose.yaml``).

    Raises:
        ComposeUnsupportedError: Naming every field the local sandbox does not run, and the fix.
    """
    path = Path(environment_dir) / COMPOSE_FILE
    if not path.is_file():
        return None
    problems = compose_problems(environment_dir)
    if problems:
        raise ComposeUnsupportedError(
            f"{len(problems)} compose feature(s) the local sandbox does not run:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    return _project(path, _unescape(yaml.safe_load(path.read_text()) or {}, str(path), []))


# -- run time -----------------------------------------------------------------


def lay_tree(
    rootfs: Path, hosts: str, volumes: Sequence[tuple[str, str, bool]], output: bool, make: tuple | None = None
) -> None:
    """A task sandbox's tree before its box starts (where the host works on trees): its ``/etc/hosts`` with the
    service names, its named volumes bound at their targets (made without following a link), and, for a
    service, the file its output goes to. ``make``: :func:`make_volumes`'s arguments (``main``'s tree, the
    first laid, makes the task's volumes)."""
    if make is not None:
        make_volumes(*make)
    _hostfs.write_text(rootfs, "/etc/hosts", hosts)
    for source, target, read_only in volumes:
        fd = _hostfs._open_dir(rootfs, _hostfs._parts(target), create=True)
        try:
            _bind(source, f"/proc/self/fd/{fd}", read_only)
        finally:
            os.close(fd)
    if output:  # written by the service's user, whoever that is
        _hostfs.write_text(rootfs, SERVICE_OUTPUT, "")
        fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY)
        try:
            os.chmod(SERVICE_OUTPUT.lstrip("/"), 0o666, dir_fd=fd)
        finally:
            os.close(fd)


_MS_BIND, _MS_REC, _MS_REMOUNT, _MS_RDONLY = 4096, 16384, 32, 1


def _bind(source: str, target: str, read_only: bool) -> None:
    libc = _libc()
    if libc.mount(source.encode(), target.encode(), None, _MS_BIND | _MS_REC, None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), target)
    if read_only and libc.mount(None, target.encode(), None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY, None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), target)


def make_volumes(folder: Path, names: Sequence[str], storage_mb: int | None) -> None:
    """The task's named volumes: folders on a bounded tmpfs of its own (where the host works on trees)."""
    folder.mkdir()
    mb = storage_mb or 1024
    mount_bounded_tmpfs(folder, mb * MiB, inode_bound(mb))
    os.chmod(folder, 0o755)
    for name in names:
        (folder / name).mkdir(mode=0o755)


def remove_volumes(folder: Path) -> None:
    """Detach and remove the task's volumes (where the host works on trees)."""
    with contextlib.suppress(OSError):
        unmount(folder)
    if folder.exists():
        _hostfs.remove_tree(folder)


def open_low_ports(pid: int) -> None:
    """Let every user bind ports below 1024 in the network namespace of ``pid`` (Docker sets
    ``net.ipv4.ip_unprivileged_port_start=0`` in its containers): a service joins ``main``'s namespace
    from a user namespace of its own, which holds no capability there. Best effort."""
    tool = which("nsenter") or "nsenter"
    subprocess.run(
        [tool, f"--net=/proc/{pid}/ns/net", "sh", "-c", "echo 0 > /proc/sys/net/ipv4/ip_unprivileged_port_start"],
        capture_output=True, env={"PATH": SYSTEM_PATH}, check=False,
    )  # fmt: skip


class ServiceRoot(ImageRoot):
    """A compose service's sandbox: its image under a private layer, in ``main``'s network namespace.

    No verifier's view is ever made of it: the image's search paths are not probed, its links not judged,
    and its ENTRYPOINT is run as the service's command (:meth:`ComposeGroup._run_service`), not at start."""

    async def _probe_search_paths(self) -> None:
        return None

    def link_hazards(self) -> dict[str, str]:
        return {}

    async def _start_entrypoint(self, entrypoint: list[str]) -> None:
        return None


@dataclass
class _Running:
    """A service's sandbox, and its command while it runs (a request to its supervisor that ends when it exits)."""

    root: ServiceRoot
    process: asyncio.Task | None = None


class ComposeGroup:
    """A compose task's services while its rollout runs: started in dependency order beside ``main``, torn down
    with it; each one's output copied to ``<trial>/services/<name>.log``."""

    def __init__(self, project: ComposeProject, task: RootTask, log_dir: Path | None):
        self.project = project
        self.task = task
        self.log_dir = log_dir
        self.running: dict[str, _Running] = {}
        self.volumes_dir: Path | None = None
        self._events: dict[str, asyncio.Future] = {}

    def volume_mounts(self, service: Service) -> list[tuple[str, str, bool]]:
        """``(host folder, target, read-only)`` for each named volume ``service`` mounts."""
        if not service.volumes:
            return []
        assert self.volumes_dir is not None
        return [(str(self.volumes_dir / m.source), m.target, m.read_only) for m in service.volumes]

    def hosts_for(self, hostname: str) -> str:
        """A sandbox's ``/etc/hosts``: Docker's, and the task's services on the shared loopback."""
        return DOCKER_HOSTS.format(hostname=hostname) + self.project.hosts

    def prepare_main(self, main: ImageRoot, storage_mb: int | None) -> None:
        """Before ``main`` starts: its tree to get the service names and its volumes (and to make the task's)."""
        make = None
        if self.project.volumes:
            self.volumes_dir = state_root() / new_box_name(f"{self.task.box_name}-volumes")
            make = (self.volumes_dir, list(self.project.volumes), storage_mb)
        mounts = self.volume_mounts(self.project.main)
        main.tree_hook = (lay_tree, (self.hosts_for(main.task.hostname), mounts, False, make))

    async def start(self, main: ImageRoot, force_build: bool, **box: Any) -> None:
        """Start every service (``main``'s box is up: its network namespace is theirs), in dependency order,
        and wait for what ``main`` depends on.

        Raises:
            ServiceError: A service could not start, exited, or never became healthy (its name, its last output).
        """
        main_box = main.running_box()
        assert main_box.init_pid is not None
        await asyncio.to_thread(main.host.call, open_low_ports, main_box.init_pid)
        for name in self.project.order():
            self._events[name] = asyncio.get_running_loop().create_future()
        # Each service's image built (or found) at once; each service starts once its dependencies are ready.
        tasks = [
            asyncio.ensure_future(self._start_one(name, main_box.init_pid, force_build, box))
            for name in self.project.order()
        ]
        try:
            await asyncio.gather(*tasks)
            await self._wait_for(MAIN, self.project.main)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _start_one(self, name: str, netns_pid: int, force_build: bool, box: dict[str, Any]) -> None:
        service = self.project.services[name]
        context = self.project.path.parent
        if service.build is not None:
            context = (context / service.build.context).resolve()
        else:
            context = context / f".no-build-context-{name}"  # none there: the root is FROM its image
        task = replace(
            self.task, environment_dir=context, name=f"{self.task.name}-{name}",
            box_name=f"{self.task.box_name}-{name}", workdir=service.working_dir, docker_image=service.image,
        )  # fmt: skip
        root = ServiceRoot(_ServiceTask.of(task, name))
        root.tree_hook = (lay_tree, (self.hosts_for(name), self.volume_mounts(service), True))
        running = self.running[name] = _Running(root)
        await root._prepare(force_build)  # every service's image built (or found) at once, before any waits
        await self._wait_for(name, service)
        config = {**box, "network": "none", "netns_of": netns_pid, "mediate_links": False, "cpus": None}
        await root.start(False, **config)
        command = self._command_of(name, service, root)
        running.process = asyncio.ensure_future(
            root.run(command, cwd=None, env=service.environment, timeout=None, user=service.user)
        )
        self._events[name].set_result(None)

    def _command_of(self, name: str, service: Service, root: ServiceRoot) -> str:
        assert root.image is not None
        entrypoint, command = service.command_line
        if entrypoint is None:
            entrypoint = root.image.config.entrypoint
            command = command if command is not None else root.image.config.cmd
        argv = [*entrypoint, *(command or [])]
        if not argv:
            raise ServiceError(
                f"compose service {name!r}: no command to run (neither the file nor its image gives one); "
                "give it a `command`",
                service=name,
            )
        return f"exec >>{SERVICE_OUTPUT} 2>&1 </dev/null; exec {shlex.join(argv)}"

    async def _wait_for(self, name: str, service: Service) -> None:
        """Wait until each of ``service``'s dependencies meets its condition."""
        for dependency, spec in service.depends_on.items():
            if dependency == MAIN:
                continue
            await asyncio.shield(self._events[dependency])
            running = self.running[dependency]
            if spec.condition == "service_healthy":
                await self._healthy(dependency, running)
            elif spec.condition == "service_completed_successfully":
                assert running.process is not None
                try:
                    result = await asyncio.shield(running.process)
                except SandboxError as error:
                    raise ServiceError(
                        f"compose service {dependency!r} (which {name!r} waits for) did not complete: {error}",
                        service=dependency,
                    ) from error
                if result["rc"] != 0:
                    output = await self.output_tail(dependency)
                    raise ServiceError(
                        f"compose service {dependency!r} (which {name!r} waits for to complete successfully) "
                        f"exited with {result['rc']}; its last output:\n{output}",
                        service=dependency, output=output,
                    )  # fmt: skip

    async def _healthy(self, name: str, running: _Running) -> None:
        """Probe ``name``'s healthcheck until it passes (``ServiceUnhealthyError`` once ``retries`` probes after
        ``start_period`` failed in a row, or the service exited). One waiter probes; the others share its answer."""
        key = f"healthy:{name}"
        if key not in self._events:
            self._events[key] = asyncio.ensure_future(self._probe(name, running))
        await asyncio.shield(self._events[key])

    async def _probe(self, name: str, running: _Running) -> None:
        service = self.project.services[name]
        check = service.healthcheck
        assert check is not None and check.command is not None
        began = time.monotonic()
        failures, last = 0, ""
        while True:
            process = running.process
            if process is not None and process.done():
                output = await self.output_tail(name)
                rc = "" if process.exception() else f" with {process.result()['rc']}"
                raise ServiceUnhealthyError(
                    f"compose service {name!r} exited{rc} before it became healthy; its last output:\n{output}",
                    service=name, output=output,
                )  # fmt: skip
            try:
                result = await running.root.run(
                    check.command, cwd=None, env=service.environment, timeout=max(check.timeout, 0.1), user=service.user
                )
                ok, last = result["rc"] == 0, (result["stdout"] + result["stderr"])[-OUTPUT_TAIL:]
            except SandboxError as error:
                ok, last = False, str(error)
            if ok:
                return
            in_start = time.monotonic() - began < check.start_period
            if not in_start:
                failures += 1
                if failures >= max(check.retries, 1):
                    output = await self.output_tail(name)
                    raise ServiceUnhealthyError(
                        f"compose service {name!r} never became healthy: {failures} healthcheck(s) failed in a row "
                        f"(`{check.command}`: {last.strip() or 'no output'}); its last output:\n{output}",
                        service=name, output=output,
                    )  # fmt: skip
            await asyncio.sleep(check.start_interval if in_start else check.interval)

    async def output_tail(self, name: str) -> str:
        """The end of what service ``name`` printed so far (copied to its log in the trial folder first)."""
        log = await self.save_output(name)
        if log is None:
            return "(no output)"
        text = log.read_bytes()[-OUTPUT_TAIL:].decode("utf-8", "replace")
        return text or "(no output)"

    async def save_output(self, name: str) -> Path | None:
        """Copy service ``name``'s output to ``<trial>/services/<name>.log`` (or a scratch file); its path."""
        running = self.running.get(name)
        if running is None or running.root.dir is None:
            return None
        folder = self.log_dir or (running.root.dir.parent / f"{running.root.dir.name}.logs")
        target = folder / f"{name}.log"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            await asyncio.to_thread(
                running.root.host.call, _hostfs.download_file, running.root.rootfs, SERVICE_OUTPUT, target
            )
        except (OSError, SandboxError) as error:
            logger.debug("harbor-local-sandbox: could not keep %s's output: %r", name, error)
            return None
        return target

    async def stop_services(self) -> None:
        """Keep each service's output, and stop every service (each process, mount and tree gone)."""
        running = self.running
        try:
            if self.log_dir is not None:
                await asyncio.gather(*(self.save_output(name) for name in running), return_exceptions=True)
            for item in running.values():
                if item.process is not None:
                    item.process.cancel()
            await asyncio.gather(*(item.root.stop() for item in running.values()), return_exceptions=True)
            for item in running.values():
                if item.process is not None:
                    with contextlib.suppress(BaseException):
                        await item.process
        finally:
            self.running = {}
            for future in self._events.values():
                if not future.done():
                    future.cancel()
                elif not future.cancelled():
                    future.exception()  # retrieved: no "never retrieved" warning

    async def remove_volumes(self, host: Any) -> None:
        """Remove the task's volumes where ``host`` (``main``'s) made them, once no tree mounts them."""
        if self.volumes_dir is not None:
            folder, self.volumes_dir = self.volumes_dir, None
            await asyncio.to_thread(host.call, remove_volumes, folder)


@dataclass(frozen=True)
class _ServiceTask(RootTask):
    """A service's :class:`RootTask`: its host name is its service name (as Docker's DNS name is)."""

    service: str = ""

    @classmethod
    def of(cls, task: RootTask, service: str) -> _ServiceTask:
        return cls(**{f: getattr(task, f) for f in task.__dataclass_fields__}, service=service)

    @property
    def hostname(self) -> str:
        return self.service
