"""Conversations through the chat template (rendered text, token ids with the loss mask) and native function
calling: tool schemas, tool-call parsers, token-exact turns."""
