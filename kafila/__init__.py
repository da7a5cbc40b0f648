"""Kafila: one model server from a trusted set of heterogeneous machines behind NATs."""

__version__ = "0.1.0"
