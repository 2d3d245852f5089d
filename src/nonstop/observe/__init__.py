"""What nonstop shows of a job: the event log, incidents and goodput, the display, the report."""
