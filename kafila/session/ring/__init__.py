"""The ring at run time: ring info, head and member roles, the schedule, the model thread, traces."""
