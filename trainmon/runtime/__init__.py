"""One attached monitor: the session, the step model (lifecycle), the collection schedule, the run directory."""
