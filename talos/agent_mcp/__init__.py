"""``talosd mcp``: a stdio MCP server that lets an agent message other agents (ADR 0012)."""
