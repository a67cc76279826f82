"""The composition root (talos/daemon.py): what ``talosd run`` builds, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from talos.daemon import Daemon
from talos.transfer.manager import TransferConfig
from talos.transfer.protocol import TransferState
from talos_sdk.keyfile import load_wallet
from tests.talos.nodes import link, make_home


async def test_transfer_runs_with_the_api_off(tmp_path: Path) -> None:
    a_home, a_cfg = make_home(tmp_path, "a")
    b_home, b_cfg = make_home(tmp_path, "b")
    assert not a_cfg.api and not b_cfg.api
    a = Daemon(a_home, a_cfg)
    accept_a = TransferConfig(auto_accept=(load_wallet(a_home / "identity.key").did,))
    b = Daemon(b_home, b_cfg, files_dir=tmp_path / "inbound", transfer=accept_a)
    await a.start()
    await b.start()
    try:
        async with asyncio.timeout(30):
            assert a.api_url is None and a.transfers is not None and b.transfers is not None
            await link(a.node, b.node)
            src = tmp_path / "payload.bin"
            src.write_bytes(b"talos" * 5000)
            tid = await a.transfers.send_file(b.node.did, src)
            done = await b.transfers.wait(tid)
            assert done.state is TransferState.COMPLETE
            assert (tmp_path / "inbound" / "payload.bin").read_bytes() == src.read_bytes()
            info = json.loads((a_home / "node.json").read_text())
            assert info["did"] == a.node.did and info["api"] is None
    finally:
        await a.stop()
        await b.stop()
    assert not (a_home / "node.json").exists()


async def test_files_dir_beats_transfer_json(tmp_path: Path) -> None:
    home, cfg = make_home(tmp_path, "a")
    (home / "transfer.json").write_text(json.dumps({"files_dir": str(tmp_path / "from-json")}))
    assert Daemon(home, cfg).files_dir == (tmp_path / "from-json").resolve()
    chosen = Daemon(home, cfg, files_dir=tmp_path / "flag").files_dir
    assert chosen == (tmp_path / "flag").resolve()
    assert Daemon(home, cfg.model_copy()).transfer_config.files_dir == tmp_path / "from-json"
