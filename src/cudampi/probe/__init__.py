"""Probes of the communication stack: pure ``parse_*(text)`` functions and thin ``query_*()``."""
