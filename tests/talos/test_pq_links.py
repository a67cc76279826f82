"""Hybrid Ed25519 + ML-DSA-65 authentication between real nodes on 127.0.0.1 (ADR 0005).

Real LMDB homes, real WebSocket links on ephemeral ports, real handshakes: a
hybrid pair uses both signatures and pins, a hybrid and a classical node still
talk, --require-pq refuses a classical peer (4009), and a pinned peer that comes
back classical is refused as a downgrade (4008).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from talos.chain import heads as hd
from talos.chain.verify import verify_chain
from talos.cli import main as talosd
from talos.config import NodeConfig
from talos.home import init_home
from talos.link.auth import CLOSE_DOWNGRADE, CLOSE_PQ_REQUIRED
from talos.link.peer import LinkSettings, PeerRefused, dial_link
from talos.node import Node
from talos.pins import load_pin
from talos_sdk.hybrid import SUITE_ED25519, SUITE_HYBRID
from talos_sdk.keyfile import load_wallet
from talos_sdk.wallet import HybridWallet, Wallet
from tests.talos.nodes import link, make_config, started, until


def home(root: Path, name: str, suite: str, **overrides: object) -> tuple[Path, NodeConfig]:
    path = root / name
    config = make_config(head_interval=0.1, **overrides)
    init_home(path, config, suite=suite)
    return path, config


@pytest.fixture
async def nodes(tmp_path: Path) -> AsyncIterator[dict[str, Node]]:
    made: dict[str, Node] = {}
    yield made
    for node in made.values():
        await node.stop()


def link_info(node: Node, did: str) -> dict[str, object]:
    (entry,) = [entry for entry in node.status()["links"] if entry["did"] == did]
    return entry


async def test_hybrid_pair_uses_both_signatures(tmp_path: Path, nodes: dict[str, Node]) -> None:
    async with asyncio.timeout(30):
        a = nodes["a"] = await started(*home(tmp_path, "a", SUITE_HYBRID))
        b = nodes["b"] = await started(*home(tmp_path, "b", SUITE_HYBRID))
        assert isinstance(a.wallet, HybridWallet)
        await link(a, b)
        for x, y in ((a, b), (b, a)):
            info = link_info(x, y.did)
            assert info["auth_suite"] == SUITE_HYBRID
            assert info["session_suite"] == "x25519-mlkem768"
            assert x.status()["auth_suite"] == SUITE_HYBRID
            with x.store.read() as txn:  # pinned on first contact
                assert load_pin(txn, y.did) == y.wallet.mldsa_public_key
        await a.send_message(b.did, "post-quantum hello", wait=True)
        assert [e.text for e in b.inbox()] == ["post-quantum hello"]
        # Hybrid-signed heads travel and verify against the pin.
        await until(
            lambda: _kept_head(b, a.did) is not None and _kept_head(a, b.did) is not None,
            what="hybrid heads exchanged",
        )
        assert len(bytes.fromhex(_kept_head(b, a.did)["signature"])) == 3373  # type: ignore[index]
        for node in (a, b):
            await asyncio.to_thread(node.log.seal)
            report = verify_chain(
                node.store, node.did, workers=1, mldsa65_public_key=node.wallet.mldsa_public_key
            )
            assert report.ok and report.blocks >= 1, report.defects
            assert all(block.version == 2 for block in node.log.iter_blocks())
        assert a.metrics.counters.get("frames_rejected", 0) == 0
        assert b.metrics.counters.get("frames_rejected", 0) == 0


def _kept_head(node: Node, did: str) -> dict[str, object] | None:
    with node.store.read() as txn:
        head = hd.load_head(txn.get("meta", hd.head_key(did)), did)
    return None if head is None else head.statement


@pytest.mark.parametrize("dialer", ["hybrid", "classical"])
async def test_hybrid_and_classical_still_talk(
    tmp_path: Path, nodes: dict[str, Node], dialer: str
) -> None:
    async with asyncio.timeout(30):
        h = nodes["h"] = await started(*home(tmp_path, "h", SUITE_HYBRID))
        c = nodes["c"] = await started(*home(tmp_path, "c", SUITE_ED25519))
        await (link(h, c) if dialer == "hybrid" else link(c, h))
        assert link_info(h, c.did)["auth_suite"] == SUITE_ED25519
        assert link_info(c, h.did)["auth_suite"] == SUITE_HYBRID
        assert link_info(c, h.did)["session_suite"] == "x25519-mlkem768"
        await c.send_message(h.did, "to hybrid", wait=True)
        await h.send_message(c.did, "to classical", wait=True)
        assert [e.text for e in h.inbox()] == ["to hybrid"]
        assert [e.text for e in c.inbox()] == ["to classical"]
        with c.store.read() as txn:
            assert load_pin(txn, h.did) == h.wallet.mldsa_public_key
        with h.store.read() as txn:
            assert load_pin(txn, c.did) is None


async def test_classical_peer_refused_under_require_pq(
    tmp_path: Path, nodes: dict[str, Node]
) -> None:
    async with asyncio.timeout(30):
        strict = nodes["s"] = await started(*home(tmp_path, "s", SUITE_HYBRID, require_pq=True))
        assert strict.status()["require_pq"] is True
        classical = Wallet.generate()
        strict.allow(classical.did)
        assert strict.listen_url is not None
        with pytest.raises(PeerRefused, match="requires hybrid") as err:
            await dial_link(
                strict.listen_url, strict.did, classical, lambda did: True, LinkSettings()
            )
        assert err.value.code == CLOSE_PQ_REQUIRED
        assert not strict.is_connected(classical.did)
        # A hybrid peer is welcome on the same node.
        peer = nodes["p"] = await started(*home(tmp_path, "p", SUITE_HYBRID))
        await link(peer, strict)
        assert link_info(strict, peer.did)["auth_suite"] == SUITE_HYBRID


async def test_downgrade_after_pinning_is_refused(tmp_path: Path, nodes: dict[str, Node]) -> None:
    async with asyncio.timeout(30):
        a = nodes["a"] = await started(*home(tmp_path, "a", SUITE_HYBRID))
        b = nodes["b"] = await started(*home(tmp_path, "b", SUITE_HYBRID))
        await link(a, b)
        seed = a.wallet.seed
        await nodes.pop("a").stop()
        # The same DID, now classical (same seed, no ML-DSA key): B has a pin.
        impostor = Wallet.from_seed(seed)
        assert impostor.did == a.did
        assert b.listen_url is not None
        with pytest.raises(PeerRefused, match="downgrade refused") as err:
            await dial_link(b.listen_url, b.did, impostor, lambda did: True, LinkSettings())
        assert err.value.code == CLOSE_DOWNGRADE
        # Another ML-DSA key under the pinned DID is refused the same way.
        other = HybridWallet.from_seed(bytes(32))
        with pytest.raises(PeerRefused) as err:
            await dial_link(
                b.listen_url,
                b.did,
                _ClaimingSigner(impostor, other.mldsa_public_key),
                lambda did: True,
                LinkSettings(),
            )
        assert err.value.code == CLOSE_DOWNGRADE and "is pinned" in err.value.reason


class _ClaimingSigner:
    """Claims an ML-DSA key it cannot sign with (a key-substitution attempt)."""

    def __init__(self, wallet: Wallet, mldsa: bytes) -> None:
        self.did = wallet.did
        self.sign = wallet.sign
        self.mldsa_public_key = mldsa


def test_cli_init_hybrid_identity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "home"
    assert (
        talosd(["init", "--home", str(path), "--suite", "ed25519-mldsa65", "--no-passphrase"]) == 0
    )
    did = capsys.readouterr().out.strip()
    wallet = load_wallet(path / "identity.key")
    assert isinstance(wallet, HybridWallet) and wallet.did == did
    with pytest.raises(SystemExit):
        talosd(["init", "--home", str(tmp_path / "x"), "--suite", "rsa"])
