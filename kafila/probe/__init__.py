"""Device probes with the backend a member will infer with: the planner's inputs.

`probe()` (kafila.probe.measure) returns a ProbeReport; `.device_report(name)` turns it into the
planner's DeviceReport.
"""
