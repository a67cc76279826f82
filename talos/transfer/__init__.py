"""File transfer between peers (issue 5; docs/PROTOCOL.md "File transfer")."""
