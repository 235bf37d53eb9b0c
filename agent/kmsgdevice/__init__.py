"""A kubelet device plugin for /dev/kmsg: the agent's container gets the kernel log without running privileged."""
