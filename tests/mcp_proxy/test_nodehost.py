"""The node a proxy embeds (mcp_proxy/nodehost.py): its home and its ratchet schedule.

docs/adr/0002-lazy-dh-ratchet.md, "The tunnel's schedule": a new proxy home
steps its DH ratchet after 64 sends or once the sending chain is 1 s old, so a
busy tunnel heals within about two seconds (a step on each side in turn) and a
slow one at every turn, as a ``talosd`` home does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mcp_proxy.nodehost import (
    TUNNEL_RATCHET_EVERY,
    TUNNEL_RATCHET_MAX_AGE,
    ensure_home,
    make_node,
)
from talos import keys
from talos.config import Home, NodeConfig
from tests.talos.test_session_policy import make


@pytest.fixture
def clock() -> list[float]:
    return [1000.0]


def test_a_new_proxy_home_gets_the_tunnels_ratchet_schedule(tmp_path: Path) -> None:
    ensure_home(tmp_path / "p", no_passphrase=True)
    config = Home(tmp_path / "p").load_config()
    assert (config.ratchet_every, config.ratchet_max_age) == (64, 1.0)
    assert config.api is False
    assert NodeConfig().ratchet_every == 1  # a talosd home keeps Signal's schedule


def test_an_existing_home_keeps_the_schedule_it_was_given(tmp_path: Path) -> None:
    home = Home(tmp_path / "p")
    ensure_home(home.path, no_passphrase=True)
    home.save_config(home.load_config().model_copy(update={"ratchet_every": 1}))
    ensure_home(home.path, no_passphrase=True)
    assert home.load_config().ratchet_every == 1


def test_turns_a_second_apart_step_the_ratchet_at_every_turn(
    tmp_path: Path, clock: list[float]
) -> None:
    """0.6 s per one-message turn: each side sends every 1.2 s, past the 1 s bound."""
    cfg = {"ratchet_every": TUNNEL_RATCHET_EVERY, "ratchet_max_age": TUNNEL_RATCHET_MAX_AGE}
    for pair in make(tmp_path, clock, **cfg):
        assert pair.ratchet_keys_in_ping_pong(40, 0.6, clock) == 40


def test_a_burst_of_turns_steps_every_64_sends_per_side(tmp_path: Path, clock: list[float]) -> None:
    """1,000 turns of 1 ms (a busy tunnel): the 64-send bound, not each turn."""
    cfg = {"ratchet_every": TUNNEL_RATCHET_EVERY, "ratchet_max_age": TUNNEL_RATCHET_MAX_AGE}
    for pair in make(tmp_path, clock, **cfg):
        keys = pair.ratchet_keys_in_ping_pong(1000, 0.001, clock)
        assert 2 * (500 // TUNNEL_RATCHET_EVERY) <= keys <= 2 * (500 // TUNNEL_RATCHET_EVERY + 2)


def test_steady_sub_second_turns_step_once_a_second_per_side(
    tmp_path: Path, clock: list[float]
) -> None:
    """100 ms per turn for 10 s: the 1 s bound steps each side about ten times."""
    cfg = {"ratchet_every": TUNNEL_RATCHET_EVERY, "ratchet_max_age": TUNNEL_RATCHET_MAX_AGE}
    for pair in make(tmp_path, clock, **cfg):
        assert 16 <= pair.ratchet_keys_in_ping_pong(100, 0.1, clock) <= 24


class _Terminal:
    def isatty(self) -> bool:
        return True


def test_a_new_identity_is_not_unlocked_again_after_its_passphrase_was_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``talos-proxy serve`` on a new home asks twice (the passphrase, then again), not thrice."""
    asked: list[str] = []
    monkeypatch.delenv("TALOS_PASSPHRASE", raising=False)
    monkeypatch.setattr(keys.sys, "stdin", _Terminal())
    monkeypatch.setattr(keys.getpass, "getpass", lambda prompt: asked.append(prompt) or "typed")
    node = make_node(tmp_path / "p", listen=None)
    assert len(asked) == 2 and keys.is_encrypted(Home(tmp_path / "p").identity)
    assert node._unlocked.did == keys.key_file_did(Home(tmp_path / "p").identity)
