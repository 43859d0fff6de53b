"""Flow matching, samplers, and random draws keyed by sample."""
