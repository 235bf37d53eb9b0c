"""The simulation wing: what only `gpu-health-agent simulate` (and the tests) need, kept out of the product's core."""
