"""Reaching peers through a NATS relay (docs/adr/0008-nats-relay.md)."""
