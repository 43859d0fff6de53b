"""The arguments of a run: schema (every key), parsing and merging, each stage's rules (no torch)."""
