"""Reaching peers through a NATS relay (docs/adr/0010-nats-relay.md)."""
