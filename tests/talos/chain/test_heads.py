"""Signed head statements between peers (talos/chain/heads.py): parse, verify, judge."""

from __future__ import annotations

import pytest

from talos.chain import heads as hd
from talos.chain.block import head_signing_bytes, head_statement
from talos_sdk.errors import MalformedFrameError
from talos_sdk.wallet import Wallet

NODE = Wallet.from_seed(bytes(range(32)))
OTHER = Wallet.from_seed(bytes(32))


def signed(height: int, block_hash: bytes, wallet: Wallet = NODE, ts: int = 1000) -> bytes:
    sig = wallet.sign(head_signing_bytes(wallet.did, height, block_hash, ts))
    return hd.encode_head(head_statement(wallet.did, height, block_hash, ts, sig))


def test_decode_verifies_signer_and_fields() -> None:
    head = hd.decode_head(signed(3, b"\x01" * 32), NODE.did)
    assert (head.node, head.height, head.hash) == (NODE.did, 3, "01" * 32)
    assert hd.load_head(hd.encode_head(head.statement), NODE.did) == head


@pytest.mark.parametrize(
    ("payload", "error", "match"),
    [
        (b"not json", MalformedFrameError, "not JSON"),
        (b"[1, 2]", MalformedFrameError, "not a JSON object"),
        (b"{" + b" " * 17000 + b"}", MalformedFrameError, "above 16384"),
        (b"[" * 8000 + b"]" * 8000, MalformedFrameError, "not JSON"),  # nested past recursion
        (signed(1, b"\x02" * 32, wallet=OTHER), hd.ForgedHeadError, "not signed by the link peer"),
        (signed(1, b"\x02" * 32).replace(b'"height":1', b'"height":2'), hd.ForgedHeadError, "not"),
    ],
)
def test_bad_head_statements_are_refused(
    payload: bytes, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        hd.decode_head(payload, NODE.did)


def test_judge_keeps_the_highest_and_flags_conflicts() -> None:
    h1 = hd.decode_head(signed(1, b"\x01" * 32), NODE.did)
    h1_again = hd.decode_head(signed(1, b"\x01" * 32, ts=2000), NODE.did)
    h1_fork = hd.decode_head(signed(1, b"\x09" * 32), NODE.did)
    h2 = hd.decode_head(signed(2, b"\x02" * 32), NODE.did)
    assert hd.judge(None, h1) == (h1, None)
    assert hd.judge(h1, h2) == (h2, None)
    assert hd.judge(h1, h1_again) == (h1, None)
    keep, conflict = hd.judge(h1, h1_fork)
    assert keep is h1 and conflict is not None
    assert conflict.reason == "same height, different block hash"
    keep, conflict = hd.judge(h2, h1)
    assert keep is h2 and conflict is not None
    assert conflict.reason == "height below one already signed"
    assert conflict.to_json()["presented"] == h1.statement
