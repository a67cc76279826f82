"""The environment a tool process starts with.

See docs/security.md "What is not protected", Tool processes.

A tool gets a clean environment by default: only the variables a program needs
to run at all (:data:`DEFAULT_PASS`, taken from ``talos-proxy serve``'s own
environment when set), then the names the server's policy entry passes
(``pass_env``), then ``--env KEY=VALUE`` of the command line, then the
server's ``env`` table. ``--pass-environment`` starts from the whole
environment of ``serve`` instead (as before this rule, and as ``mcp-proxy``
allows). Secrets of the proxy host therefore reach a tool only when named.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from mcp_proxy.policy import PolicyError, ServerSpec

__all__ = ["DEFAULT_PASS", "parse_env_assignments", "tool_environment"]

DEFAULT_PASS: Final = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "USER")


def parse_env_assignments(items: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings (``--env``) as a mapping; PolicyError names a bad one."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or "\x00" in item:
            raise PolicyError(f"--env needs KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def tool_environment(
    spec: ServerSpec,
    source: Mapping[str, str],
    *,
    extra: Mapping[str, str] | None = None,
    pass_all: bool = False,
) -> dict[str, str]:
    """The environment for one tool of ``spec``, built from ``source`` (serve's environment)."""
    if pass_all:
        env = dict(source)
    else:
        env = {name: source[name] for name in DEFAULT_PASS if name in source}
    env.update((name, source[name]) for name in spec.pass_env if name in source)
    if extra:
        env.update(extra)
    env.update(spec.env)
    return env
