"""The GPU edge: what acts on the GPU itself (the reset procedure), apart from the Kubernetes edge."""
