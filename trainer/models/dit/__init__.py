"""relay's own video DiT: config (torch-free), module."""
