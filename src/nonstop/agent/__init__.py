"""One host's processes: start, watch, signal; their mailboxes and health checks."""
