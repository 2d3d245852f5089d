"""Talking between hosts: an authenticated message channel over TCP (see channel.py)."""
