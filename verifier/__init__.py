"""The target engine."""
