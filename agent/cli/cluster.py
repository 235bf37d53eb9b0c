"""`release` and `cleanup`: an operator's commands against the cluster."""

from __future__ import annotations

import click

from agent.cli.common import EXIT_FAILED, config_of, fail, reporting_bad_input
from agent.config import load_config
from agent.k8s.detect import cluster_configured


@click.command()
@click.option("--node", "node_name", help="The node (default: NODE_NAME or this host's name).")
@click.option("--gpu", "gpu_uuid", default="all", show_default=True, help="A GPU UUID, or all.")
@click.option("--kubeconfig", type=click.Path(), help="Kubeconfig (default: in-cluster, then KUBECONFIG).")
@reporting_bad_input
def release(node_name: str | None, gpu_uuid: str, kubeconfig: str | None) -> None:
    """Release faults only an operator may clear (needs-replacement, ...): the node's agent clears them."""
    from agent.cluster_side import request_release  # noqa: PLC0415
    from agent.k8s.client import load_api_client  # noqa: PLC0415 - the client is loaded only when needed

    config = load_config(None)
    name = node_name or config.node_name
    if not cluster_configured(kubeconfig or config.remediation.kubeconfig or None):
        fail(["release: no cluster (no in-cluster configuration and no kubeconfig)"], code=1)
    api_client, _ = load_api_client(kubeconfig=kubeconfig or config.remediation.kubeconfig or None)
    with api_client:
        request_release(api_client, name, gpu_uuid)
    click.echo(f"node/{name}: release of {gpu_uuid} requested; the agent applies it within "
               f"{config.remediation.node_sync_seconds:g}s")


@click.command()
@click.option("--all-nodes", is_flag=True, help="Every node of the cluster, plus DeviceTaintRules and Leases.")
@click.option("--node", "nodes", multiple=True, help="Only this node (repeatable).")
@click.option("--dry-run", is_flag=True, help="List what would be removed; change nothing.")
@click.option("--force", is_flag=True, help="Clean even while agent pods still run (they will set marks again).")
@click.option("--config", "config_path", type=click.Path(), help="The agent's config (its taint key, namespace).")
@click.option("--kubeconfig", type=click.Path(), help="Kubeconfig with operator credentials (default: KUBECONFIG).")
@reporting_bad_input
def cleanup(all_nodes: bool, nodes: tuple[str, ...], dry_run: bool, force: bool, config_path: str | None,
            kubeconfig: str | None) -> None:
    """Remove every mark the agent left (taint, its cordon, conditions, labels, annotations, DeviceTaintRules,
    its Lease) and nothing it did not set. Run after uninstalling; --dry-run lists them first."""
    from agent.cleanup import Cleaner, Scope  # noqa: PLC0415 - the client is loaded only when needed
    from agent.k8s.client import load_api_client  # noqa: PLC0415

    if all_nodes == bool(nodes):
        fail(["cleanup: give --all-nodes or --node NAME (not both)"])
    config = config_of(config_path)
    api_client, how = load_api_client(kubeconfig=kubeconfig)
    if api_client is None:
        fail([f"cleanup: no cluster ({how})"], code=EXIT_FAILED)
    with api_client:
        cleaner = Cleaner.connect(api_client, Scope(taint_key=config.remediation.taint_key,
                                                    namespace=config.remediation.namespace, nodes=nodes))

        def say(line: str) -> None:
            click.echo(f"cleanup: {line}", err=True)

        say(f"cluster via {how}")
        running = cleaner.agent_pods()
        if running and not dry_run and not force:
            fail([f"cleanup: {len(running)} agent pod(s) still run in namespace {config.remediation.namespace} and "
                   "would set their marks again: uninstall first (or --force)"], code=EXIT_FAILED)
        marks = cleaner.find(progress=say)
        for mark in marks:
            if dry_run:
                click.echo(f"would remove {mark.line()}")
            else:
                click.echo(f"{'removed' if cleaner.remove(mark) else 'already gone'}: {mark.line()}")
        if all_nodes and cleaner.pause_lease_present():
            say(f"left lease/{config.remediation.namespace}/gpu-health-pause: an operator's pause switch "
                "(kubectl delete lease it yourself)")
        done = "would remove" if dry_run else "removed"
        say(f"{done} {len(marks)} mark(s)" + ("; run again without --dry-run to remove them" if dry_run and marks
                                              else "" if marks else " (nothing the agent set was found)"))
