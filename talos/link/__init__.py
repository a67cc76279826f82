"""Peer links: frame layout (wire), the mutual handshake, and the asyncio link."""
