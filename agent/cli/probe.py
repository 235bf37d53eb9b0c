"""`probe`: every agent of the DaemonSet Ready and answering on its node (the chart's `helm test` runs it)."""

from __future__ import annotations

import click

from agent.cli.common import EXIT_FAILED, fail, reporting_bad_input


@click.command()
@click.option("--namespace", default="gpu-health", show_default=True, help="The agent's namespace.")
@click.option("--daemonset", default="gpu-health-agent", show_default=True, help="The agent's DaemonSet.")
@click.option("--port", type=click.IntRange(1, 65535), default=9402, show_default=True,
              help="The agents' metrics port (/healthz, /readyz).")
@click.option("--timeout", "timeout_seconds", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              help="Seconds each answer may take.")
@click.option("--kubeconfig", type=click.Path(), help="Kubeconfig (default: in-cluster, then KUBECONFIG).")
@reporting_bad_input
def probe(namespace: str, daemonset: str, port: int, timeout_seconds: float, kubeconfig: str | None) -> None:
    """Check that each node the DaemonSet runs on has its agent Ready and answering /healthz and /readyz: one
    line a node; exit 1 when one does not, or the DaemonSet is to run on no node."""
    from agent.install_probe import asked, judge, read_agent_pods  # noqa: PLC0415 - loaded when it runs
    from agent.k8s.client import Timeouts, load_api_client  # noqa: PLC0415

    api, _ = load_api_client(kubeconfig=kubeconfig, timeouts=Timeouts(connect=timeout_seconds,
                                                                      read=timeout_seconds))
    with api:
        desired, pods = read_agent_pods(api, namespace, daemonset)
    verdict = judge(desired, asked(pods, port, timeout_seconds))
    if not verdict.ok:
        fail([f"probe: {line}" for line in verdict.lines], code=EXIT_FAILED)
    for line in verdict.lines:
        click.echo(f"probe: {line}")
