"""The control part: classifier, feedback, reconciler, step runner and record store (docs/control-map.md)."""
