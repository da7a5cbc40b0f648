"""Forming a session: the pure formation cores, their driver, host and join steps, the links."""
