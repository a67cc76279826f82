"""talos/relay/serverconf.py: one NATS account per node, each reaching the others' subjects."""

from __future__ import annotations

import json

from talos.relay.names import RelayNames
from talos.relay.serverconf import account_name, accounts_block, render_server_config
from talos_sdk.wallet import Wallet

DIDS = [Wallet.from_seed(bytes([i]) * 32).did for i in (1, 2, 3)]


def _accounts(text: str) -> dict[str, dict[str, object]]:
    block = text.split("accounts: ", 1)[1]
    return dict(json.loads(block))


def test_each_node_is_an_account_exporting_its_subjects_and_importing_the_others() -> None:
    accounts = _accounts(accounts_block(DIDS, mailbox_bytes=1 << 20))
    assert sorted(accounts) == sorted(account_name(did) for did in DIDS)
    for did in DIDS:
        own = RelayNames.for_did(did)
        account = accounts[account_name(did)]
        assert account["jetstream"] == {
            "max_file": 1 << 20,
            "max_mem": 0,
            "max_streams": 1,
            "max_consumers": 4,
        }
        assert account["exports"] == [{"service": own.link}, {"service": own.mailbox}]
        imported = {
            (i["service"]["account"], i["service"]["subject"])  # type: ignore[index]
            for i in account["imports"]  # type: ignore[attr-defined]
        }
        others = [o for o in DIDS if o != did]
        assert imported == {
            (account_name(o), s)
            for o in others
            for s in (RelayNames.for_did(o).link, RelayNames.for_did(o).mailbox)
        }
        (user,) = account["users"]  # type: ignore[misc]
        assert user["permissions"]["subscribe"]["allow"] == [own.link, f"{own.inbox_prefix}.>"]


def test_the_store_holds_every_mailbox_unless_told_otherwise() -> None:
    text = render_server_config(DIDS, mailbox_bytes=1 << 20)
    (line,) = [x for x in text.splitlines() if x.startswith("jetstream: ")]
    assert json.loads(line.split(": ", 1)[1])["max_file_store"] == 3 * (1 << 20) + (16 << 20)
    text = render_server_config(DIDS, max_store="4G")
    assert '"max_file_store": "4G"' in text
    assert account_name(DIDS[0]).startswith("TALOS_") and DIDS[0] not in text
