"""The node's tamper-evident block log (docs/DESIGN.md "Block log", docs/PROTOCOL.md "Block log").

``block`` holds the pure rules (records, blocks, validity), ``log`` the
LMDB-backed :class:`BlockLog`, ``verify`` the whole-log audit.
"""

from talos.chain.block import Block, ChainDefect, Record, validate_block, verify_inclusion_proof
from talos.chain.log import BlockLog, Head, run_sealer
from talos.chain.verify import VerifyReport, verify_chain

__all__ = [
    "Block",
    "BlockLog",
    "ChainDefect",
    "Head",
    "Record",
    "VerifyReport",
    "run_sealer",
    "validate_block",
    "verify_chain",
    "verify_inclusion_proof",
]
