"""Tool-call parsers: one module per dialect, sharing :mod:`.base`."""
