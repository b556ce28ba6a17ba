"""Native function calling: tool schemas, tool-call parsers, token-exact turns."""
