"""``TerminalNotesEnv``: shell commands (blocking or in the background), file writes and notes."""
