"""Draft engines."""
