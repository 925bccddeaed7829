"""Integrations of ftrun's rank-level recovery with training frameworks (each an optional extra)."""
