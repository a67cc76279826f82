"""docker-compose.yml, Dockerfile and deploy/entrypoint.sh refer to things that exist.

No Docker here: the compose file is parsed (PyYAML), the Dockerfile's COPY
sources are checked on disk, every ``talosd`` / ``talos-proxy`` subcommand and
flag the entrypoint uses is looked up in the real ``--help`` output, and the
entrypoint itself is run outside a container (homes in tmp dirs, 127.0.0.1,
free ports) until the compose healthchecks pass against it.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENTRYPOINT = ROOT / "deploy" / "entrypoint.sh"
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def _services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services built from this repository (every one but the NATS server)."""
    services = {n: s for n, s in compose["services"].items() if "build" in s}
    assert services, "no services"
    return services


def _entrypoint_roles() -> set[str]:
    text = ENTRYPOINT.read_text()
    case = text[text.index('case "$role" in') :]
    return set(re.findall(r"^\s+(\w+)\)\s*$", case, flags=re.M))


def test_every_service_builds_this_repository(compose: dict[str, Any]) -> None:
    for name, svc in _services(compose).items():
        context = ROOT / str(svc["build"])
        assert (context / "Dockerfile").is_file(), f"{name}: no Dockerfile in {context}"


def test_dockerfile_copies_paths_that_exist() -> None:
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    copies = [shlex.split(line)[1:] for line in lines if line.startswith("COPY ")]
    assert copies
    for args in copies:
        for src in args[:-1]:
            assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"
    # Every package the image installs with `pip install .` is copied in.
    copied = {Path(src).name for args in copies for src in args[:-1]}
    assert {"talos_sdk", "talos", "mcp_proxy", "pyproject.toml"} <= copied
    entry = next(line for line in lines if line.startswith("ENTRYPOINT"))
    target = next(args[-1] for args in copies if args[0] == "deploy/entrypoint.sh")
    assert Path(target).name in entry


def test_dockerfile_installs_the_tool_the_entrypoint_runs() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "mcp-server-time" in text
    assert "python -m mcp_server_time" in ENTRYPOINT.read_text()


def test_services_use_known_roles_and_declared_volumes(compose: dict[str, Any]) -> None:
    roles = _entrypoint_roles()
    assert roles == {"node", "tool", "agent", "natsconf"}
    declared = set(compose["volumes"])
    names = set(_services(compose))
    used: set[str] = set()
    for name, svc in _services(compose).items():
        role, _own, *others = svc["command"]
        assert role in roles, f"{name}: unknown role {role}"
        # Peers / allowed identities are other services (their DIDs get published).
        assert set(others) <= names - {name}, f"{name}: {others} are not services"
        for volume in svc["volumes"]:
            source, target = volume.split(":")[:2]
            used.add(source)
            assert source in declared, f"{name}: volume {source} not declared"
            assert target in ("/home/talos/node", "/directory")
    for volume in compose["services"]["nats"]["volumes"]:
        used.add(volume.split(":")[0])
    assert used == declared, f"declared but unused volumes: {declared - used}"


def test_node_healthchecks_hit_healthz_on_the_entrypoint_api_port(
    compose: dict[str, Any],
) -> None:
    api_port = re.search(r"api_port=\$\{TALOS_API_PORT:-(\d+)\}", ENTRYPOINT.read_text())
    port = re.search(r"port=\$\{TALOS_PORT:-(\d+)\}", ENTRYPOINT.read_text())
    http_port = re.search(r"http_port=\$\{TALOS_HTTP_PORT:-(\d+)\}", ENTRYPOINT.read_text())
    assert api_port and port and http_port
    for name, svc in _services(compose).items():
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD"
        code = test[-1]
        if svc["command"][0] == "node":
            assert f"http://127.0.0.1:{api_port.group(1)}/healthz" in code, name
        elif svc["command"][0] == "agent":
            assert f"('127.0.0.1', {http_port.group(1)})" in code, name
        elif svc["command"][0] == "natsconf":
            assert test == ["CMD", "test", "-s", "/directory/nats.conf"], name
        elif svc.get("environment", {}).get("TALOS_RELAY"):
            assert test == ["CMD", "kill", "-0", "1"], name  # serves through the relay: no port
        else:
            assert f"('127.0.0.1', {port.group(1)})" in code, name


def _help(*cmd: str) -> str:
    done = subprocess.run(
        [str(BIN / cmd[0]), *cmd[1:], "--help"],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_entrypoint_uses_only_existing_subcommands_and_flags() -> None:
    calls = []
    for line in ENTRYPOINT.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        for m in re.finditer(r"\b(talosd|talos-proxy) (\w[\w-]*)([^;|)]*)", line):
            calls.append((m.group(1), m.group(2), re.findall(r"(--[a-z][a-z-]*)", m.group(3))))
    used = {(prog, sub) for prog, sub, _ in calls}
    assert used == {("talosd", "init"), ("talosd", "id"), ("talosd", "run"),
                    ("talos-proxy", "id"), ("talos-proxy", "serve"),
                    ("talos-proxy", "connect"), ("talosd", "relay-config")}  # fmt: skip
    for prog, sub, flags in calls:
        assert re.search(rf"\b{sub}\b", _help(prog)), f"{prog} has no subcommand {sub}"
        sub_help = _help(prog, sub)
        for flag in flags:
            assert flag in sub_help, f"`{prog} {sub}` has no flag {flag}"
    # The peer flags built in loops: `--peer` for nodes, `--allow` for the tool.
    assert "--peer" in _help("talosd", "run")
    assert "--allow" in _help("talos-proxy", "serve")
    assert "--http" in _help("talos-proxy", "connect")  # on the agent's continuation line


def test_the_tool_allows_the_agent_service_which_dials_it(compose: dict[str, Any]) -> None:
    services = _services(compose)
    tools = [n for n, svc in services.items() if svc["command"][0] == "tool"]
    agents = [n for n, svc in services.items() if svc["command"][0] == "agent"]
    assert tools == ["time-tool", "relay-tool"] and agents == ["agent", "relay-agent"]
    assert services["relay-tool"]["command"][2:] == ["relay-agent"]
    assert services["relay-agent"]["command"][1:] == ["relay-agent", "relay-tool"]
    # serve --allows exactly the identities that can call it: the agent's own home.
    assert services["time-tool"]["command"][2:] == ["agent"]
    assert services["agent"]["command"][1:] == ["agent", "time-tool"]
    homes = [svc["volumes"][0].split(":")[0] for svc in services.values()]
    assert len(homes) == len(set(homes)), "two services share a home (its store is locked)"


# --- the entrypoint, run for real outside a container -------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthcheck(svc: dict[str, Any], replace: dict[str, str]) -> list[str]:
    cmd = list(svc["healthcheck"]["test"][1:])
    code = cmd[-1]
    for old, new in replace.items():
        code = code.replace(old, new)
    return [sys.executable if cmd[0] == "python" else cmd[0], *cmd[1:-1], code]


def _until_healthy(cmd: list[str], proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"entrypoint exited with {proc.returncode}:\n{log.read_text()}")
        if subprocess.run(cmd, capture_output=True, timeout=DEADLINE_S).returncode == 0:
            return
        time.sleep(0.2)
    pytest.fail("healthcheck never passed")


@pytest.fixture
def entry_env(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    directory = tmp_path / "directory"
    directory.mkdir()
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "TALOS_DIRECTORY": str(directory),
        "TALOS_BIND": "127.0.0.1",
    }
    yield env, directory


def _start(
    env: dict[str, str], home: Path, *args: str, stderr: Any = None
) -> tuple[subprocess.Popen[bytes], int, int]:
    """Run the entrypoint; its stderr goes to ``<home>.log`` unless told otherwise."""
    port, api_port = _free_port(), _free_port()
    env = {**env, "TALOS_NODE_HOME": str(home), "TALOS_PORT": str(port),
           "TALOS_API_PORT": str(api_port)}  # fmt: skip
    if stderr is not None:
        proc = subprocess.Popen(
            ["sh", str(ENTRYPOINT), *args], env=env, stdout=subprocess.DEVNULL, stderr=stderr
        )
    else:
        with home.with_suffix(".log").open("wb") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                ["sh", str(ENTRYPOINT), *args], env=env, stdout=subprocess.DEVNULL, stderr=log
            )
    return proc, port, api_port


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()


def test_entrypoint_node_and_tool_pass_their_healthchecks(
    compose: dict[str, Any], tmp_path: Path, entry_env: tuple[dict[str, str], Path]
) -> None:
    env, directory = entry_env
    services = _services(compose)
    node, _, api_port = _start(env, tmp_path / "alice", "node", "alice")
    try:
        _until_healthy(
            _healthcheck(services["alice"], {"7401": str(api_port)}), node, tmp_path / "alice.log"
        )
        did = (directory / "alice.did").read_text().strip()
        shown = subprocess.run(
            [str(BIN / "talosd"), "id", "--home", str(tmp_path / "alice")],
            capture_output=True, text=True, timeout=DEADLINE_S, check=True,
        ).stdout.strip()  # fmt: skip
        assert did == shown and did.startswith("did:key:z6Mk")

        tool, tool_port, _ = _start(env, tmp_path / "tool", "tool", "time-tool", "alice")
        try:
            check = _healthcheck(services["time-tool"], {"7400": str(tool_port)})
            _until_healthy(check, tool, tmp_path / "tool.log")
            assert (directory / "time-tool.did").read_text().startswith("did:key:z6Mk")
        finally:
            _stop(tool)
        assert tool.returncode == 0
    finally:
        _stop(node)
    assert node.returncode == 0


def test_entrypoint_refuses_an_unknown_role(
    tmp_path: Path, entry_env: tuple[dict[str, str], Path]
) -> None:
    env, _ = entry_env
    proc, _, _ = _start(env, tmp_path / "x", "relay", "x", stderr=subprocess.PIPE)
    _, err_bytes = proc.communicate(timeout=DEADLINE_S)
    err = err_bytes.decode()
    assert proc.returncode == 2
    assert "unknown role: relay" in err
    assert not (tmp_path / "x").exists(), "an identity was created for a bad role"


def _mcp_post(port: int, token: str, body: dict[str, Any], session: str | None) -> Any:
    """One Streamable HTTP POST to the agent; the JSON-RPC reply of a request, else None."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE_S)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
               "Accept": "application/json, text/event-stream"}  # fmt: skip
    if session is not None:
        headers["Mcp-Session-Id"] = session
    try:
        conn.request("POST", "/mcp", json.dumps(body), headers)
        resp = conn.getresponse()
        if "id" not in body:
            assert resp.status == 202, resp.read()
            return None
        assert resp.status == 200, resp.read()
        if resp.headers["Content-Type"].startswith("application/json"):
            return resp.headers["Mcp-Session-Id"], json.loads(resp.read())
        for raw in resp:  # SSE: the reply is the first data line
            line = raw.decode().strip()
            if line.startswith("data:"):
                return resp.headers["Mcp-Session-Id"], json.loads(line[5:])
        pytest.fail("no reply on the event stream")
    finally:
        conn.close()


def test_entrypoint_agent_reaches_the_tool_over_talos(
    compose: dict[str, Any], tmp_path: Path, entry_env: tuple[dict[str, str], Path]
) -> None:
    """The compose wiring end to end: agent (connect --http) -> link -> time-tool (serve)."""
    env, directory = entry_env
    services = _services(compose)
    tool, tool_port, _ = _start(env, tmp_path / "tool", *services["time-tool"]["command"])
    http_port = _free_port()
    agent_env = {**env, "TALOS_PEER_HOST": "127.0.0.1", "TALOS_PEER_PORT": str(tool_port),
                 "TALOS_HTTP_PORT": str(http_port)}  # fmt: skip
    agent, _, _ = _start(agent_env, tmp_path / "agent", *services["agent"]["command"])
    try:
        check = _healthcheck(services["agent"], {"7402": str(http_port)})
        _until_healthy(check, agent, tmp_path / "agent.log")
        token = (tmp_path / "agent" / "proxy-http.token").read_text().strip()
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                           "clientInfo": {"name": "compose-test", "version": "0"}}}  # fmt: skip
        deadline = time.monotonic() + DEADLINE_S
        while True:  # the link to the tool may still be coming up
            session, reply = _mcp_post(http_port, token, init, None)
            if "result" in reply or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert reply["result"]["serverInfo"]["name"], reply
        _mcp_post(http_port, token, {"jsonrpc": "2.0", "method": "notifications/initialized"},
                  session)  # fmt: skip
        args = {"name": "get_current_time", "arguments": {"timezone": "UTC"}}
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": args}
        _, reply = _mcp_post(http_port, token, call, session)
        assert reply["id"] == 2 and reply["result"]["isError"] is False, reply
        assert '"timezone": "UTC"' in reply["result"]["content"][0]["text"]
        assert (directory / "agent.did").read_text() != (directory / "time-tool.did").read_text()
    finally:
        _stop(agent)
        _stop(tool)
    assert agent.returncode == 0 and tool.returncode == 0


# --- the relay part: separate networks, nothing published, NATS in between ----------------------


def test_relay_nodes_share_no_network_and_publish_no_port(compose: dict[str, Any]) -> None:
    services = compose["services"]
    relayed = {n for n, svc in services.items() if svc.get("environment", {}).get("TALOS_RELAY")}
    assert relayed == {"north", "south", "relay-tool", "relay-agent"}
    for name in relayed:
        assert services[name]["environment"]["TALOS_RELAY"] == "nats://nats:4222"
    nets = {n: set(services[n]["networks"]) for n in relayed}
    assert not nets["north"] & nets["south"], "north and south could dial each other"
    assert not nets["relay-tool"] & nets["relay-agent"]
    assert set(services["nats"]["networks"]) == nets["north"] | nets["south"]
    for name, svc in services.items():
        assert "ports" not in svc, f"{name} publishes a port"
    assert services["nats"]["depends_on"]["nats-config"]["condition"] == (
        "service_completed_successfully"
    )
    # The relay's users are exactly the relayed services (nats-config waits for their DIDs).
    assert set(services["nats-config"]["command"][2:]) == relayed
    assert services["nats"]["command"] == ["-c", "/directory/nats.conf"]


def test_entrypoint_relayed_nodes_message_each_other_through_nats(
    tmp_path: Path, entry_env: tuple[dict[str, str], Path]
) -> None:
    """north and south as compose runs them (no --listen), the relay config from natsconf."""
    from tests.talos.relay.natsd import nats_server_binary

    binary = nats_server_binary()
    env, directory = entry_env
    nats_port = _free_port()
    relay_env = {**env, "TALOS_RELAY": f"nats://127.0.0.1:{nats_port}",
                 "TALOS_NATS_HOST": "127.0.0.1", "TALOS_NATS_PORT": str(nats_port),
                 "TALOS_NATS_STORE": str(tmp_path / "js"),
                 "TALOS_NATS_MONITOR": str(_free_port())}  # fmt: skip
    north, _, _ = _start(relay_env, tmp_path / "north", "node", "north", "south")
    south, _, _ = _start(relay_env, tmp_path / "south", "node", "south", "north")
    conf, _, _ = _start(relay_env, tmp_path / "conf", "natsconf", "nats-config", "north", "south")
    server = None
    try:
        assert conf.wait(timeout=DEADLINE_S) == 0
        server = subprocess.Popen(
            [binary, "-c", str(directory / "nats.conf")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        south_did = (directory / "south.did").read_text().strip()
        # `send --wait` needs north's node up, not only its entrypoint started.
        deadline = time.monotonic() + DEADLINE_S
        while subprocess.run(
            [str(BIN / "talosd"), "status", "--home", str(tmp_path / "north")],
            capture_output=True, timeout=DEADLINE_S, check=False,
        ).returncode != 0:  # fmt: skip
            assert time.monotonic() < deadline, "north's node never came up"
            time.sleep(0.2)
        sent = subprocess.run(
            [str(BIN / "talosd"), "send", "--home", str(tmp_path / "north"), "--wait",
             "--timeout", "60", south_did, "hello across networks"],
            capture_output=True, text=True, timeout=DEADLINE_S + 30,
        )  # fmt: skip
        assert sent.returncode == 0, sent.stderr
        inbox = subprocess.run(
            [str(BIN / "talosd"), "inbox", "--home", str(tmp_path / "south"), "--json"],
            capture_output=True, text=True, timeout=DEADLINE_S, check=True,
        )  # fmt: skip
        assert [m["text"] for m in json.loads(inbox.stdout)] == ["hello across networks"]
        status = subprocess.run(
            [str(BIN / "talosd"), "status", "--json", "--home", str(tmp_path / "north")],
            capture_output=True, text=True, timeout=DEADLINE_S, check=True,
        )  # fmt: skip
        links = json.loads(status.stdout)["links"]
        assert [x["via"] for x in links if x["did"] == south_did] == ["relay"]
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=DEADLINE_S)
        _stop(north)
        _stop(south)
