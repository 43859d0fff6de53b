"""Optimizers (Muon + AdamW), LR schedules, EMA."""
