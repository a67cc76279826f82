"""mcp_proxy: the MCP tunnel over Talos nodes (docs/DESIGN.md layer 3)."""
