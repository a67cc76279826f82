"""Real MCP servers used as tools by the tunnel tests."""
