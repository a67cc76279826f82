"""File transfer between peers (docs/PROTOCOL.md "File transfer"; ADR 0004)."""
