"""Pure decisions over plain data: faults, the ladder, detection rules, takeover. No I/O, and
nothing of the controller's (``controller/`` uses these, never the other way)."""
