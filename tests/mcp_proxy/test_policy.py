"""Tests for mcp_proxy.policy: default deny, tool lists, the TOML file, tools/list filtering."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from mcp_proxy.policy import (
    DEFAULT_SERVER,
    Policy,
    PolicyDenied,
    PolicyError,
    load_policy_file,
)
from talos_sdk.did import did_from_public_key
from talos_sdk.errors import DIDError
from tests.talos.bad_dids import BAD_DIDS

ALICE, BOB, EVE = (did_from_public_key(bytes([n]) * 32) for n in (1, 2, 3))

POLICY_TOML = f"""
[servers.time]
command = "python"
args = ["-m", "mcp_server_time"]
env = {{ TZ = "UTC" }}

[servers.everything]
command = "python"
args = ["-m", "tests.tools.everything_server"]

[peers."{ALICE}"]
servers = ["everything"]
tools = ["echo", "add"]

[peers."{BOB}"]
"""


def tools_list(*names: str) -> bytes:
    tools = [{"name": n, "inputSchema": {"type": "object"}} for n in names]
    return orjson.dumps({"jsonrpc": "2.0", "id": 1, "result": {"tools": tools}})


def test_default_deny_and_allow() -> None:
    policy = Policy.build(allow=[ALICE], command=["tool", "--flag"])
    assert policy.is_peer_allowed(ALICE)
    assert not policy.is_peer_allowed(EVE)
    name, spec = policy.server_for(ALICE, "")
    assert name == DEFAULT_SERVER
    assert (spec.command, spec.args) == ("tool", ("--flag",))
    with pytest.raises(PolicyDenied, match="not allowed"):
        policy.server_for(EVE, "")


def test_global_tools_list() -> None:
    policy = Policy.build(allow=[ALICE], tools=["echo"], command=["tool"])
    assert policy.tool_allowed(ALICE, "echo")
    assert not policy.tool_allowed(ALICE, "crash")
    assert not policy.tool_allowed(EVE, "echo")
    assert policy.restricts_tools(ALICE)
    assert not Policy.build(allow=[ALICE], command=["t"]).restricts_tools(ALICE)


def test_policy_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(POLICY_TOML)
    policy = Policy.build(policy_file=load_policy_file(path))
    assert policy.is_peer_allowed(ALICE) and policy.is_peer_allowed(BOB)
    assert not policy.is_peer_allowed(EVE)
    assert policy.server_for(ALICE, "everything")[0] == "everything"
    # Allowed exactly one server: it is chosen without being named.
    assert policy.server_for(ALICE, "")[0] == "everything"
    # A server granted to others and one that does not exist get the same answer.
    with pytest.raises(PolicyDenied) as granted_to_others:
        policy.server_for(ALICE, "time")
    with pytest.raises(PolicyDenied) as absent:
        policy.server_for(ALICE, "nope")
    assert str(granted_to_others.value) == "no server named 'time' is offered to you"
    assert str(absent.value) == "no server named 'nope' is offered to you"
    with pytest.raises(PolicyDenied, match="choose one of"):
        policy.server_for(BOB, "")
    with pytest.raises(PolicyDenied, match="no server named 'nope'"):
        policy.server_for(BOB, "nope")
    assert policy.server_for(BOB, "time")[1].env == {"TZ": "UTC"}
    assert policy.tool_allowed(ALICE, "add") and not policy.tool_allowed(ALICE, "crash")
    assert policy.tool_allowed(BOB, "anything")


def test_filter_tools_list() -> None:
    policy = Policy.build(allow=[ALICE], tools=["echo", "add"], command=["t"])
    out = orjson.loads(policy.filter_tools_list(ALICE, tools_list("echo", "crash", "add")))
    assert [t["name"] for t in out["result"]["tools"]] == ["echo", "add"]
    assert out["id"] == 1
    error = b'{"jsonrpc":"2.0","id":1,"error":{"code":-1,"message":"x"}}'
    assert policy.filter_tools_list(ALICE, error) == error


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not = [toml", "not valid TOML"),
        ("[servers.x]\nargs = []\n", "invalid"),
        ("[servers.x]\ncommand = 'a'\nbogus = 1\n", "invalid"),
        ('[peers."did:key:z"]\ntools = "echo"\n', "invalid"),
    ],
)
def test_bad_policy_file(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(PolicyError, match=match):
        load_policy_file(path)


@pytest.mark.parametrize(("did", "what"), BAD_DIDS)
def test_policy_file_peer_key_must_be_a_full_did(tmp_path: Path, did: str, what: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(f'[peers."{did}"]\n')
    with pytest.raises(DIDError, match=re.escape(f"{did}: not a valid did:key: ")) as info:
        load_policy_file(path)
    assert str(info.value).startswith(f"policy file {path}: ")
    assert what in str(info.value)


def test_missing_policy_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy_file(tmp_path / "absent.toml")


def test_bad_build_arguments(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="no tool server"):
        Policy.build(allow=[ALICE])
    with pytest.raises(DIDError, match=r"^--allow alice: not a valid did:key: not a DID"):
        Policy.build(allow=["alice"], command=["t"])
    path = tmp_path / "p.toml"
    path.write_text(f'[peers."{ALICE}"]\nservers = ["ghost"]\n')
    with pytest.raises(PolicyError, match="unknown server 'ghost'"):
        Policy.build(command=["t"], policy_file=load_policy_file(path))
    path.write_text('[servers.default]\ncommand = "x"\n')
    with pytest.raises(PolicyError, match="given twice"):
        Policy.build(command=["t"], policy_file=load_policy_file(path))
