"""Sources: each watches one thing (kernel log, NVML, DCGM, a scenario) and emits Observations."""
