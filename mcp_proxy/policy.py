"""Who may use which tool server and which tools (docs/DESIGN.md "MCP tunnel").

Default deny. A DID is allowed when it is named by ``--allow`` or has a
``[peers."did:..."]`` table in the policy file; anyone else is refused at the
link by the node's authorizer. A policy file (TOML) looks like::

    [servers.remote]                    # or a Streamable HTTP server to bridge to
    url = "https://mcp.example/mcp"
    headers = { Authorization = "Bearer ..." }

    [servers.time]                      # name -> command, args, env
    command = "python"
    args = ["-m", "mcp_server_time"]
    env = { TZ = "UTC" }                # set for the tool
    pass_env = ["AWS_PROFILE"]          # taken from serve's environment when set

    [peers."did:key:z6Mk..."]
    servers = ["time"]                  # "*" (the default): every server
    tools = ["get_current_time"]        # "*" (the default): every tool

``--tools`` narrows every caller to a global allow list on top of that.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from talos.peer_refs import check_did
from talos_sdk.errors import UsageError

__all__ = [
    "DEFAULT_SERVER",
    "Policy",
    "PolicyDenied",
    "PolicyError",
    "PolicyFile",
    "ServerSpec",
    "load_policy_file",
]

DEFAULT_SERVER = "default"
WILDCARD = "*"


class PolicyError(UsageError):
    """The policy file or the command line policy options are invalid."""


class PolicyDenied(UsageError):
    """A caller asked for a server or tool the policy does not grant."""


class ServerSpec(BaseModel):
    """One tool server: a stdio command to start, or a Streamable HTTP ``url`` to bridge to."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    command: str = ""
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    pass_env: tuple[str, ...] = ()
    url: str = ""
    headers: dict[str, str] = Field(default_factory=dict)  # sent with every upstream request

    @model_validator(mode="after")
    def _command_or_url(self) -> ServerSpec:
        if bool(self.command) == bool(self.url):
            raise ValueError("a server needs exactly one of command or url")
        if self.url and urlsplit(self.url).scheme not in ("http", "https"):
            raise ValueError(f"url must be http:// or https://, got {self.url!r}")
        return self


class PeerRule(BaseModel):
    """What one caller DID may use."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    servers: tuple[str, ...] = (WILDCARD,)
    tools: tuple[str, ...] = (WILDCARD,)


class PolicyFile(BaseModel):
    """The TOML policy file, validated at the boundary."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    servers: dict[str, ServerSpec] = Field(default_factory=dict)
    peers: dict[str, PeerRule] = Field(default_factory=dict)


def load_policy_file(path: Path) -> PolicyFile:
    """Read and validate a TOML policy file; PolicyError names what is wrong."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PolicyError(f"cannot read policy file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"policy file {path} is not valid TOML: {exc}") from exc
    try:
        policy = PolicyFile.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(f"policy file {path} is invalid: {exc}") from exc
    for did in policy.peers:
        check_did(did, f"policy file {path}: [peers.KEY] with KEY")
    return policy


def _as_set(names: Iterable[str]) -> frozenset[str] | None:
    """None means "everything" (a wildcard entry)."""
    names = frozenset(names)
    return None if WILDCARD in names else names


@dataclass(frozen=True, slots=True)
class _Grant:
    servers: frozenset[str] | None
    tools: frozenset[str] | None


@dataclass(frozen=True, slots=True)
class Policy:
    """The policy in force on a ``talos-proxy serve`` side."""

    servers: Mapping[str, ServerSpec]
    grants: Mapping[str, _Grant] = field(default_factory=dict)
    global_tools: frozenset[str] | None = None

    @classmethod
    def build(
        cls,
        *,
        allow: Iterable[str] = (),
        tools: Iterable[str] | None = None,
        command: Iterable[str] = (),
        policy_file: PolicyFile | None = None,
        url: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> Policy:
        """Combine ``--allow``, ``--tools``, ``-- CMD ARGS`` or ``--url``, and ``--policy FILE``."""
        servers: dict[str, ServerSpec] = {}
        argv = list(command)
        if argv and url:
            raise PolicyError("give either -- CMD ARGS or --url, not both")
        if argv:
            servers[DEFAULT_SERVER] = ServerSpec(command=argv[0], args=tuple(argv[1:]))
        if url:
            try:
                servers[DEFAULT_SERVER] = ServerSpec(url=url, headers=dict(headers or {}))
            except ValidationError as exc:
                raise PolicyError(f"--url: {exc.errors()[0]['msg']}") from None
        grants: dict[str, _Grant] = {}
        if policy_file is not None:
            for name, spec in policy_file.servers.items():
                if name in servers:
                    raise PolicyError(f"server {name!r} is given twice")
                servers[name] = spec
            for did, rule in policy_file.peers.items():
                grant = _Grant(_as_set(rule.servers), _as_set(rule.tools))
                for server in grant.servers or ():
                    if server not in servers:
                        raise PolicyError(f"peer {did} names unknown server {server!r}")
                grants[did] = grant
        for did in allow:
            grants.setdefault(check_did(did, "--allow"), _Grant(None, None))
        if not servers:
            raise PolicyError("no tool server: give -- CMD ARGS or [servers.NAME] in --policy")
        global_tools = None if tools is None else _as_set(tools)
        return cls(servers, grants, global_tools)

    def is_peer_allowed(self, did: str) -> bool:
        """The node's link authorizer: default deny."""
        return did in self.grants

    def servers_for(self, did: str) -> list[str]:
        """The servers ``did`` may open, sorted (none for a DID the policy does not name)."""
        grant = self.grants.get(did)
        if grant is None:
            return []
        if grant.servers is None:
            return sorted(self.servers)
        return sorted(name for name in grant.servers if name in self.servers)

    def server_for(self, did: str, name: str) -> tuple[str, ServerSpec]:
        """Resolve the server a session asked for ("" = the caller's only or default one).

        A refusal names only servers ``did`` may use: an unknown server and one
        granted to others get the same answer.
        """
        if did not in self.grants:
            raise PolicyDenied(f"{did} is not allowed")
        mine = self.servers_for(did)
        if not name:
            if DEFAULT_SERVER in mine:
                name = DEFAULT_SERVER
            elif len(mine) == 1:
                name = mine[0]
            elif not mine:
                raise PolicyDenied("no server is offered to you")
            else:
                raise PolicyDenied(f"several servers are offered to you, choose one of {mine}")
        if name not in mine:
            raise PolicyDenied(f"no server named {name!r} is offered to you")
        return name, self.servers[name]

    def tool_allowed(self, did: str, tool: str) -> bool:
        """Whether ``did`` may call ``tool`` (both the global and the per-DID list must agree)."""
        if self.global_tools is not None and tool not in self.global_tools:
            return False
        grant = self.grants.get(did)
        if grant is None:
            return False
        return grant.tools is None or tool in grant.tools

    def restricts_tools(self, did: str) -> bool:
        """Whether tools/list replies for ``did`` need filtering at all (the hot path skips it)."""
        grant = self.grants.get(did)
        return self.global_tools is not None or grant is None or grant.tools is not None

    def filter_tools_list(self, did: str, response: bytes) -> bytes:
        """Rewrite a tools/list response so it lists only the tools ``did`` may call."""
        obj: Any = orjson.loads(response)
        result: Any = obj.get("result") if isinstance(obj, dict) else None
        tools = result.get("tools") if isinstance(result, dict) else None
        if not isinstance(tools, list):
            return response
        result["tools"] = [
            tool
            for tool in tools
            if isinstance(tool, dict)
            and isinstance(tool.get("name"), str)
            and self.tool_allowed(did, tool["name"])
        ]
        return orjson.dumps(obj)
