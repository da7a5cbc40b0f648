"""Operator tooling (kafila-ops)."""
