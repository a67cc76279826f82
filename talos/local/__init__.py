"""Local clients of a running node: the owner-only Unix socket in its home (ADR 0012)."""
