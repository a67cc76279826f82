"""Node configuration and the layout of a node home (docs/DESIGN.md "Who uses it").

A home folder holds everything one node owns::

    <home>/identity.key   Ed25519 wallet (0600)
    <home>/config.json    NodeConfig (pydantic, below), file transfer in its "transfer"
                          section (TransferConfig; <home>/transfer.json of older
                          versions is still read, see :func:`transfer_settings`)
    <home>/api.token      bearer token of the control API (0600)
    <home>/store/         the LMDB environment (talos/store.py)
    <home>/node.json      written by a running node: its link and API addresses

Addresses of peers are ``ws://HOST:PORT#DID``: the fragment pins the identity
the link handshake must prove (docs/PROTOCOL.md "Link protocol").
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from talos.logging import event
from talos.peer_refs import (
    PeerAddr,
    check_did,
    check_peer_addr,
    host_port_url,
    parse_peer_addr,
)
from talos_sdk.errors import UsageError

__all__ = [
    "LEGACY_TRANSFER_FILE",
    "Home",
    "NodeConfig",
    "PeerAddr",
    "TransferConfig",
    "configured_peer",
    "default_home",
    "parse_listen",
    "parse_peer_addr",
    "parse_relay_url",
    "transfer_settings",
]

log = logging.getLogger("talos.config")

#: Where file-transfer settings lived before config.json's ``transfer`` section.
LEGACY_TRANSFER_FILE = "transfer.json"
#: Longest a lazy sending chain lives (``ratchet_max_age`` with ``ratchet_every > 1``).
MAX_RATCHET_AGE = 3600.0


class TransferConfig(BaseModel):
    """File-transfer settings: the ``transfer`` section of config.json (docs/operations.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    files_dir: Path | None = Field(default=None, description="where received files land")
    auto_accept: tuple[str, ...] = Field(default=(), description="DIDs whose offers need no accept")
    quota_bytes: int = Field(default=64 << 30, ge=0, description="bytes of incoming files held")
    min_file_bytes: int = Field(
        default=64 << 10,
        ge=1,
        description="what each incoming file counts against the quota at least (its row, inode)",
    )
    max_rows_per_peer: int = Field(
        default=10_000,
        ge=1,
        description="incoming transfer rows kept per peer; the oldest ended ones are dropped",
    )
    bulk: bool = True
    bulk_host: str = "127.0.0.1"
    bulk_port: int = Field(default=0, ge=0, le=65535)
    window: int = Field(default=8, ge=1, le=1024, description="chunks in flight")
    checkpoint_bytes: int = Field(default=32 << 20, ge=1 << 16)
    retry_delay: float = Field(default=0.2, gt=0)


#: Hosts the control API may listen on: it is for local clients only (docs/security.md).
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


class NodeConfig(BaseModel):
    """Everything a node can be told; stored as ``<home>/config.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    listen: str | None = Field(default=None, description="HOST:PORT for peer links")
    peers: tuple[str, ...] = Field(default=(), description="ws://HOST:PORT#DID to dial")
    allow: tuple[str, ...] = Field(default=(), description="extra DIDs allowed to link")
    relays: tuple[str, ...] = Field(
        default=(),
        description="nats://HOST:PORT servers of one NATS relay (docs/adr/0010-nats-relay.md)",
    )
    mailbox_max_age: float = Field(
        default=7 * 86400.0, gt=0, description="seconds the relay keeps mail for this node"
    )
    mailbox_max_bytes: int = Field(
        default=64 << 20, ge=1 << 16, description="bytes the relay keeps for this node"
    )
    api: bool = True
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=0, ge=0, le=65535)
    map_size: int = Field(default=1 << 30, ge=1 << 20)
    inbox_share: int = Field(
        default=0,
        ge=0,
        description="bytes of inbox messages one peer may keep stored here before its"
        " next ones wait at its end (0: an eighth of map_size)",
    )
    max_frame: int = Field(default=1 << 20, ge=16 * 1024)  # wire.MIN_MAX_FRAME
    ratchet_every: int = Field(
        default=1,
        ge=1,
        description="DH ratchet step every turn (1) or lazily after N sends (ADR 0002)",
    )
    ratchet_max_age: float = Field(
        default=60.0,
        gt=0,
        description="seconds: a lazy sending chain (ratchet_every > 1) is renewed when older",
    )
    one_time_prekeys: int = Field(default=8, ge=0, le=1000)
    pq_one_time_prekeys: int = Field(
        default=4, ge=0, le=100, description="signed one-time ML-KEM-768 prekeys kept offered"
    )
    prekey_rotation: float = Field(
        default=7 * 86_400.0, gt=0, description="seconds between signed prekey rotations"
    )
    prekey_grace: float = Field(
        default=14 * 86_400.0, ge=0, description="seconds a replaced signed prekey still works"
    )
    pq: bool = True
    require_pq: bool = Field(
        default=False, description="refuse peers without hybrid Ed25519 + ML-DSA-65 auth"
    )
    seal_count: int = Field(default=256, ge=1, le=4096)  # chain.block.MAX_BLOCK_RECORDS
    seal_interval: float = Field(default=1.0, gt=0)
    ping_interval: float = Field(default=20.0, gt=0)
    handshake_timeout: float = Field(default=10.0, gt=0)
    reconnect_initial: float = Field(default=0.1, gt=0)
    reconnect_max: float = Field(default=10.0, gt=0)
    retry_interval: float = Field(default=3.0, gt=0)
    session_flush_interval: float = Field(default=1.0, gt=0)
    head_interval: float = Field(
        default=5.0, gt=0, description="seconds between signed-head announcements to peers"
    )
    log_format: Literal["kv", "json"] = "kv"
    transfer: TransferConfig | None = Field(
        default=None,
        description="file-transfer settings; None: not given here (see transfer_settings)",
    )

    @model_validator(mode="after")
    def _check_ratchet_age(self) -> Self:
        # Lazy mode only (the value is unused with 1): a chain renews within the hour,
        # so a typo cannot turn healing by time off (docs/security.md).
        if self.ratchet_every > 1 and self.ratchet_max_age > MAX_RATCHET_AGE:
            raise ValueError(
                f"ratchet_max_age must be at most {MAX_RATCHET_AGE:g} s when ratchet_every > 1"
            )
        return self

    @field_validator("api_host")
    @classmethod
    def _check_api_host(cls, value: str) -> str:
        # Refused here, when the config is read, not once the node has started.
        if value not in LOOPBACK_HOSTS:
            raise ValueError(f"must be a loopback host ({', '.join(LOOPBACK_HOSTS)})")
        return value

    @field_validator("relays")
    @classmethod
    def _check_relays(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(parse_relay_url(v) for v in value)

    @field_validator("peers")
    @classmethod
    def _check_peers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_peer_addr(v) for v in value)

    @field_validator("allow")
    @classmethod
    def _check_allow(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_did(v) for v in value)


def validation_text(exc: ValidationError) -> str:
    """Pydantic's errors on one line: ``field: what is wrong; ...`` (no URLs, no input echo)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


def parse_relay_url(value: str) -> str:
    """Check ``nats://HOST:PORT`` (or ``tls://``); returns it unchanged."""
    parts = host_port_url(
        value, ("nats", "tls"), "relay address", "relay must look like nats://HOST:PORT"
    )
    if parts.username or parts.password or parts.path not in ("", "/") or parts.query:
        raise UsageError(
            f"relay address must be nats://HOST:PORT only (the node signs in with its key):"
            f" {value!r}"
        )
    return value


def parse_listen(value: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (port 0 picks a free port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"listen address must be HOST:PORT, got {value!r}")
    if int(port) > 65535:
        raise UsageError(f"listen port {port} out of range (0-65535; 0 picks a free one)")
    return host.strip("[]"), int(port)


def default_home() -> Path:
    """``$TALOS_HOME`` or ``~/.talos``."""
    env = os.environ.get("TALOS_HOME")
    return Path(env).expanduser() if env else Path.home() / ".talos"


def _write_private(path: Path, data: bytes) -> None:
    """Create ``path`` 0600 from the start (never world-readable, even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, 0o600)


@dataclass(frozen=True, slots=True)
class Home:
    """Paths inside one node home."""

    path: Path

    @property
    def identity(self) -> Path:
        return self.path / "identity.key"

    @property
    def config_file(self) -> Path:
        return self.path / "config.json"

    @property
    def token_file(self) -> Path:
        return self.path / "api.token"

    @property
    def store_dir(self) -> Path:
        return self.path / "store"

    @property
    def node_file(self) -> Path:
        return self.path / "node.json"

    def exists(self) -> bool:
        return self.identity.exists()

    def load_config(self) -> NodeConfig:
        if not self.config_file.exists():
            return NodeConfig()
        try:
            return NodeConfig.model_validate_json(self.config_file.read_bytes())
        except ValidationError as exc:
            raise UsageError(f"invalid config {self.config_file}: {validation_text(exc)}") from None

    def save_config(self, config: NodeConfig) -> None:
        unset = {"transfer"} if config.transfer is None else None  # no "transfer": null
        self.config_file.write_text(config.model_dump_json(indent=2, exclude=unset) + "\n")

    def api_token(self) -> str:
        try:
            return self.token_file.read_text().strip()
        except FileNotFoundError:
            raise UsageError(f"no API token in {self.path}: run `talosd init` first") from None

    def create_api_token(self) -> str:
        token = secrets.token_urlsafe(32)
        _write_private(self.token_file, token.encode() + b"\n")
        return token

    def write_node_info(self, info: dict[str, object]) -> None:
        tmp = self.node_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2) + "\n")
        tmp.replace(self.node_file)

    def read_node_info(self) -> dict[str, object] | None:
        try:
            data = json.loads(self.node_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None


_noted: set[tuple[str, Path]] = set()  # one note per home and process


def transfer_settings(home: Path, config: NodeConfig) -> TransferConfig:
    """The node's file-transfer settings: config.json's ``transfer`` section.

    A home set up before that section existed may still hold
    ``<home>/transfer.json``: it is read when config.json has no ``transfer``
    section, with a one-line deprecation note (once per home and process);
    when both exist, config.json wins and the old file is ignored (noted too).
    """
    legacy = Path(home) / LEGACY_TRANSFER_FILE
    if config.transfer is not None:
        if legacy.exists():
            _note_once(
                "transfer_json_ignored",
                legacy,
                "config.json has a transfer section, which wins: delete the old file",
            )
        return config.transfer
    if not legacy.exists():
        return TransferConfig()
    try:
        settings = TransferConfig.model_validate_json(legacy.read_bytes())
    except ValidationError as exc:
        raise UsageError(f"invalid transfer settings {legacy}: {exc}") from None
    _note_once(
        "transfer_json_deprecated",
        legacy,
        f'move its contents into the "transfer" section of {Path(home) / "config.json"}'
        " and delete it",
    )
    return settings


def _note_once(name: str, path: Path, fix: str) -> None:
    key = (name, path.resolve())
    if key not in _noted:
        _noted.add(key)
        event(log, name, logging.WARNING, file=str(path), fix=fix)


def configured_peer(config: NodeConfig, did: str) -> bool:
    """Whether ``config`` names ``did`` (``peers`` or ``allow``): a node started with it
    dials or allows the peer again, whatever its store says."""
    return did in config.allow or any(p.endswith("#" + did) for p in config.peers)
