"""The one exception tree of Talos (docs/DESIGN.md "Conventions").

Every error Talos raises on purpose derives from :class:`TalosError`. Errors
that mean *the caller misused the API* are kept apart from errors that mean
*the remote party broke the protocol*, and every failed decryption is the same
opaque :class:`DecryptionError` so that nothing leaks which check failed::

    TalosError
    ├── UsageError                 caller passed something invalid (also ValueError)
    │   ├── EncodingError          not representable as RFC 8785 JSON / bad bytes form
    │   ├── DIDError               not a well-formed did:key we support
    │   ├── MessageTooLargeError   text above both nodes' frame bound (talos/pipeline.py)
    │   ├── UnknownRecordError     no sealed record with that id (talos/chain/log.py; also KeyError)
    │   ├── BadAddressError        not a usable ws:// peer address (talos/discovery.py)
    │   ├── PassphraseNeededError  no terminal to ask for a key file's passphrase (talos/keys.py)
    │   ├── UnknownPeerNameError   a peer name this node does not know (talos/peer_names.py)
    │   ├── PolicyError            a policy file that cannot be used (mcp_proxy/policy.py)
    │   ├── HeavyDigestError       too long to digest on the event loop (mcp_proxy/audit_record.py)
    │   └── PolicyDenied           the policy refuses this caller / tool (mcp_proxy/policy.py)
    ├── KeyFileError               a key file cannot be read or written
    │   └── WrongPassphraseError   passphrase does not open the key file
    ├── ProtocolError              the peer sent something the protocol forbids
    │   ├── MalformedFrameError    bytes do not parse as the frame they claim to be
    │   │   └── TunnelFrameError   an MCP tunnel frame (mcp_proxy/tunnel_wire.py)
    │   ├── OversizeError          a frame / message above the negotiated bound
    │   ├── BundleError            prekey bundle: bad signature, unknown suite, reused OPK
    │   ├── HandshakeError         link handshake failed or peer refused
    │   │   ├── Refusal            we refuse the peer (talos/link/handshake.py)
    │   │   ├── PeerRefused        the peer refused us (talos/link/handshake.py)
    │   │   └── PeerSuiteError     suite or hybrid key not acceptable (talos_sdk/hybrid.py)
    │   │       ├── DowngradeError
    │   │       ├── PinnedKeyChangedError
    │   │       └── PostQuantumRequiredError
    │   ├── PartyMismatchError     a frame names other parties (talos_sdk/frames.py)
    │   ├── UnknownSessionError    no session with that peer (talos/sessions.py)
    │   ├── MessageSignatureError  a MSG without a valid sender signature (talos/sessions.py)
    │   │   ├── UnsignedMessageError
    │   │   └── BadMessageSignatureError
    │   ├── ForgedHeadError        a head not signed by the link peer (talos/chain/heads.py)
    │   ├── StreamBroken           a relay stream out of order / oversize (talos/relay/wire.py)
    │   ├── WebSocketError         a WebSocket frame RFC 6455 forbids (talos/link/wsframe.py)
    │   ├── JsonRpcError           a JSON-RPC message we must refuse (mcp_proxy/jsonrpc.py)
    │   └── TransferProtocolError  file transfer (talos/transfer/protocol.py)
    │       ├── CreditExceededError    chunk beyond the granted credit (transfer/incoming.py)
    │       ├── IntegrityError         size or SHA-256 mismatch (transfer/receiver.py)
    │       └── SourceChangedError     the file changed while sending (transfer/sender.py)
    ├── DecryptionError            opaque: tampered, replayed, wrong key, wrong AD
    ├── SignatureError             a signature that must verify did not
    ├── StorageError               the node's store failed, or a stored row is corrupt
    │   ├── StorageFullError       LMDB map full: nothing was written
    │   ├── StoreInUseError        another process holds the home's store (talos/store.py)
    │   └── NoSpaceError           the disk cannot hold a received file (transfer/receiver.py)
    ├── ChainError                 the block log has a defect (node layer)
    │   └── ChainDefect            one defect found by verification (talos/chain/block.py)
    │       ├── MalformedChainDataError  (also a MalformedFrameError: records come from peers)
    │       ├── BlockHeightError, BlockLinkError, BlockNodeError, RecordCountError
    │       ├── MerkleRootError, BlockSignatureError, RecordSignatureError
    │       └── RecordIndexError       (talos/chain/verify.py)
    ├── NotConnectedError          no ready link to that peer (node_apps.py; also ConnectionError)
    │   └── ConnectTimeoutError    wait_connected gave up (also TimeoutError)
    ├── LinkRefusedError           a link was refused, by the peer or us (talos/node_links.py)
    ├── MessageDroppedError        a queued message the user dropped (talos/pipeline.py)
    ├── PeerUnreachableError       the peer cannot be reached now (also ConnectionError)
    ├── LinkDownError              the tunnel's peer is not linked (mcp_proxy/transport.py)
    ├── NoNodeError                nothing listens on the home's local socket (talos/local/call.py)
    ├── NodeGoneError              the node stopped while attached (also ConnectionError)
    ├── LocalCallError             a local call answered with an error (talos/local/call.py)
    │   └── LocalUsageError        ... because of the call's input (also UsageError)
    └── RelayError                 the NATS relay (node layer, talos/relay/client.py)
        ├── RelayUnavailableError  not connected, or the peer is not on it (also ConnectionError)
        ├── MailboxUnavailableError  the recipient has no mailbox on the relay
        └── MailboxFullError       the recipient's mailbox is at its limits

Upper layers (``talos``, ``mcp_proxy``) subclass these; they do not start new roots.
Every exception class of the product appears above
(tests/test_errors_tree.py checks it).
"""

from __future__ import annotations

__all__ = [
    "BundleError",
    "ChainError",
    "DIDError",
    "DecryptionError",
    "EncodingError",
    "HandshakeError",
    "KeyFileError",
    "LinkRefusedError",
    "MalformedFrameError",
    "OversizeError",
    "PeerUnreachableError",
    "ProtocolError",
    "SignatureError",
    "StorageError",
    "StorageFullError",
    "TalosError",
    "UsageError",
    "WrongPassphraseError",
]


class TalosError(Exception):
    """Root of every error Talos raises on purpose."""


class UsageError(TalosError, ValueError):
    """The caller passed an argument the API does not accept."""


class EncodingError(UsageError):
    """A value cannot be encoded (RFC 8785 JSON, compact bytes forms)."""


class DIDError(UsageError):
    """A DID string is malformed or uses a method / key type we do not support."""


class KeyFileError(TalosError):
    """A key file is missing, unreadable, or not in a format we know."""


class WrongPassphraseError(KeyFileError):
    """The passphrase given does not decrypt the key file."""


class ProtocolError(TalosError):
    """The remote party sent something the protocol does not allow."""


class MalformedFrameError(ProtocolError):
    """Bytes that do not parse as the structure they claim to be."""


class OversizeError(ProtocolError):
    """A frame or message larger than the bound in force."""


class BundleError(ProtocolError):
    """A prekey bundle that fails verification or cannot be used."""


class HandshakeError(ProtocolError):
    """The link handshake failed: bad proof, pinned DID mismatch, or refusal."""


class DecryptionError(TalosError):
    """A message could not be decrypted. Deliberately says nothing about why."""

    def __init__(self, message: str = "decryption failed") -> None:
        super().__init__(message)


class SignatureError(TalosError):
    """A signature that is required to verify did not."""


class StorageError(TalosError):
    """The node's persistent store failed."""


class StorageFullError(StorageError):
    """The LMDB map is full; the write was rolled back and nothing was lost."""


class ChainError(TalosError):
    """The block log has a defect (broken link, bad root, bad signature)."""


class LinkRefusedError(TalosError):
    """A link to the peer was refused: by the peer (its allow list, pins, PQ policy)
    or by this node. Neither misuse nor a protocol fault: a decision of one side."""


class PeerUnreachableError(TalosError, ConnectionError):
    """The peer cannot be reached right now (no address, connection refused, no route)."""
