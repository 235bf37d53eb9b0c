"""The fleet controller (`gpu-health-agent fleet run`): leader-elected, watches the nodes' fleet summaries,
correlates them with agent.fleet and publishes the holds nodes read; and the operator's `fleet` commands."""
