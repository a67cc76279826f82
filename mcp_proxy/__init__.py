"""mcp_proxy: the MCP tunnel over Talos nodes (DESIGN.md layer 3)."""
