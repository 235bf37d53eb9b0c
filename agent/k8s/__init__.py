"""Everything that talks to the Kubernetes API (the only package that imports `kubernetes`)."""
