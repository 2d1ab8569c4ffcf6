"""Faces: what people and outside agents use, and what nothing else imports: the CLI (`cli`, with `fastcli` as its
console script), the MCP server (`mcp_server`), the live view (`views`) and `demo`."""
