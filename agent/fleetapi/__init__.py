"""The API side of every object the nodes' agents and the fleet controller share: the disruption budget's slots,
the quarantine brake's claims, the holds object and the census, the controller's leader Lease (the pure rules are
agent.fleet; agent.k8s keeps the client and this node's actuators)."""
