"""Validation during training, pixel scorers, inference and export, media files."""
