"""File-transfer settings in config.json's ``transfer`` section; the old
``<home>/transfer.json`` still read, with a deprecation note (talos/config.py
``transfer_settings``, docs/cli.md "Configuration")."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from talos.config import Home, NodeConfig, TransferConfig, transfer_settings
from talos.daemon import Daemon
from talos_sdk.did import did_from_public_key
from talos_sdk.errors import UsageError
from tests.talos.daemons import Daemon as TalosdProcess
from tests.talos.daemons import talosd

PEER = did_from_public_key(bytes(range(32)))


class Notes(logging.Handler):
    """The warnings talos.config logs (attached to its logger: works whatever the root does)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def events(self) -> list[tuple[str, dict[str, str]]]:
        return [(r.getMessage(), dict(getattr(r, "talos_fields", {}))) for r in self.records]


@pytest.fixture
def notes() -> Iterator[Notes]:
    handler = Notes()
    logger = logging.getLogger("talos.config")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _home(tmp_path: Path, section: dict[str, object] | None, legacy: object = None) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    config: dict[str, object] = {"api": False}
    if section is not None:
        config["transfer"] = section
    (home / "config.json").write_text(json.dumps(config))
    if legacy is not None:
        (home / "transfer.json").write_text(json.dumps(legacy))
    return home


def test_config_section_is_honoured(tmp_path: Path, notes: Notes) -> None:
    home = _home(tmp_path, {"auto_accept": [PEER], "files_dir": str(tmp_path / "in"), "window": 4})
    settings = transfer_settings(home, Home(home).load_config())
    assert settings == TransferConfig(auto_accept=(PEER,), files_dir=tmp_path / "in", window=4)
    assert notes.events() == []


def test_no_settings_anywhere_gives_the_defaults(tmp_path: Path, notes: Notes) -> None:
    home = _home(tmp_path, None)
    assert transfer_settings(home, Home(home).load_config()) == TransferConfig()
    assert notes.events() == []


def test_old_transfer_json_is_read_with_one_deprecation_note(tmp_path: Path, notes: Notes) -> None:
    home = _home(tmp_path, None, legacy={"auto_accept": [PEER], "quota_bytes": 1 << 20})
    config = Home(home).load_config()
    for _ in range(3):  # read again and again: noted once
        settings = transfer_settings(home, config)
        assert settings.auto_accept == (PEER,) and settings.quota_bytes == 1 << 20
    [(name, fields)] = notes.events()
    assert name == "transfer_json_deprecated"
    assert fields["file"] == str(home / "transfer.json")
    assert '"transfer" section' in fields["fix"] and str(home / "config.json") in fields["fix"]


def test_config_json_wins_when_both_exist(tmp_path: Path, notes: Notes) -> None:
    home = _home(
        tmp_path,
        {"auto_accept": [PEER]},
        legacy={"auto_accept": [], "files_dir": str(tmp_path / "old")},
    )
    settings = transfer_settings(home, Home(home).load_config())
    assert settings.auto_accept == (PEER,)
    assert settings.files_dir is None  # nothing of the old file is mixed in
    [(name, fields)] = notes.events()
    assert name == "transfer_json_ignored"
    assert "delete the old file" in fields["fix"]


def test_malformed_old_file_is_a_clear_error(tmp_path: Path) -> None:
    home = _home(tmp_path, None, legacy={"window": 0, "nonsense": 1})
    with pytest.raises(UsageError, match=r"invalid transfer settings .*transfer\.json"):
        transfer_settings(home, Home(home).load_config())


def test_malformed_section_is_a_clear_error(tmp_path: Path) -> None:
    home = _home(tmp_path, {"window": "many"})
    with pytest.raises(UsageError, match=r"invalid config .*config\.json"):
        Home(home).load_config()


def test_save_config_writes_no_empty_section(tmp_path: Path) -> None:
    home = Home(tmp_path)
    home.save_config(NodeConfig())
    assert "transfer" not in json.loads(home.config_file.read_text())
    home.save_config(NodeConfig(transfer=TransferConfig(window=2)))
    assert Home(tmp_path).load_config().transfer == TransferConfig(window=2)


def test_daemon_takes_the_section_and_files_dir_flag_beats_it(tmp_path: Path) -> None:
    home = tmp_path / "a"
    assert talosd("init", "--home", str(home), "--no-passphrase").returncode == 0
    config = Home(home).load_config()
    config = config.model_copy(
        update={"api": False, "transfer": TransferConfig(files_dir=tmp_path / "section")}
    )
    Home(home).save_config(config)
    assert Daemon(home).files_dir == (tmp_path / "section").resolve()
    assert Daemon(home, files_dir=tmp_path / "flag").files_dir == (tmp_path / "flag").resolve()


def test_talosd_run_logs_the_deprecation_note_once(tmp_path: Path) -> None:
    home = tmp_path / "a"
    assert talosd("init", "--home", str(home), "--no-passphrase").returncode == 0
    (home / "transfer.json").write_text(json.dumps({"auto_accept": [PEER]}))
    node = TalosdProcess(home, "--listen", "127.0.0.1:0")
    assert node.stop() == 0
    lines = [line for line in node.stderr if "transfer_json_deprecated" in line]
    assert len(lines) == 1, node.stderr
    assert "level=warning" in lines[0]
    assert f"file={home / 'transfer.json'}" in lines[0]
    assert "config.json" in lines[0]
