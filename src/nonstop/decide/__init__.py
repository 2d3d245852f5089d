"""Pure decisions over plain data: faults, the ladder, detection rules, liveness, takeover. No I/O."""
