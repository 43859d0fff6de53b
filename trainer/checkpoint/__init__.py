"""Checkpoints: format, atomic writes, checksums, resume, warm start, export."""
