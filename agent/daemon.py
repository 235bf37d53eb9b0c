"""The long-running agent: sources on their own threads feed one classification loop; the reconciler
converges the cluster on a thread of its own; HTTP, reload, shutdown."""

from __future__ import annotations

import csv
import hashlib
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from agent.config import Config
from agent.discovery import DISABLED_IN_CONFIG, LOUD_WHEN_MISSING, SourceContext, SourceProbe, discover_sources
from agent.engine import RuleSet, builtin_rules_dir, load_rules
from agent.engine.loader import rule_files
from agent.engine.reload import NAMED, refusal
from agent.errors import AgentError, InputErrors
from agent.hot_path import describe as describe_storm_path
from agent.journal import Journal
from agent.logs import get_logger
from agent.metrics import Metrics
from agent.model import NodeInventory, Observation, Step, StepKind, Verdict, frozen_attrs
from agent.remediation.record import OwedEvent
from agent.sources.attribution import gpus_by_pod_uid
from agent.sources.backlog import Backlog
from agent.sources.base import Source
from agent.wiring import pipeline_of

if TYPE_CHECKING:
    from agent.cluster_side import ClusterSide, NodeHooks
    from agent.gpu.reset import DeviceReset, ResetExecutor, ResetProcedure
    from agent.k8s.operands import OperandPauser
    from agent.sources.nvml import NvmlSource

log = get_logger("agent.daemon")
JOURNAL_PRUNE_SECONDS = 3600.0
#: The rule a GPU the node had and NVML no longer finds raises (rules/node.yaml).
#: The rules of a missing GPU whose release the NVML source must hear of, so that it stops raising it.
GPU_MISSING_RULES = frozenset({"gpu-missing", "gpu-not-enumerated"})
#: Observations the backlog holds before it folds repeats (new kinds are admitted up to twice this).
BACKLOG_CAPACITY = 10_000
#: SIGTERM to exit: the DaemonSet grants 30 s; everything not yet applied is in the journal for the next agent.
SHUTDOWN_SECONDS = 5.0
#: Observations taken from the backlog at a time (one lock, one wake-up): ~10 ms of a storm's work at most.
DRAIN_BATCH = 256
#: How long a start without a journal record waits for the Node's copy before detection starts anyway.
START_WAIT_SECONDS = 10.0


def rules_dir_of(config: Config) -> Path:
    return Path(config.rules_dir) if config.rules_dir else builtin_rules_dir()


def device_reset_of(config: Config) -> DeviceReset:
    """The privileged part of a reset as configured: where it runs (the reset container, or this process)."""
    from agent.gpu.reset import DeviceReset  # noqa: PLC0415 - the GPU edge only where a reset can be asked for

    settings = config.remediation
    proc = Path(settings.reset_proc_root)
    return DeviceReset(command=list(settings.reset_command), timeout_seconds=settings.reset_timeout_seconds,
                       holder_wait_seconds=settings.reset_holder_wait_seconds, proc_root=proc,
                       driver_root=proc / "driver" / "nvidia" / "gpus",
                       ignored_holders=frozenset(settings.reset_ignored_holders))


def reset_executor_of(config: Config) -> ResetExecutor:
    """The reset container through its socket where one is configured, else the reset in this process."""
    settings = config.remediation
    if settings.reset_helper_socket:
        from agent.gpu.helper import HelperClient  # noqa: PLC0415 - only where the reset container is configured

        return HelperClient(settings.reset_helper_socket,
                            timeout_seconds=settings.reset_timeout_seconds + settings.reset_holder_wait_seconds + 30)
    return device_reset_of(config)


class RulesWatcher:
    """Notices a changed rules directory by its files' names, sizes and modification times."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.fingerprint = self._fingerprint()

    def _fingerprint(self) -> str:
        digest = hashlib.sha256()
        try:
            for path in rule_files(self.directory):
                stat = path.stat()
                digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
        except OSError as exc:
            digest.update(f"error:{exc.errno}".encode())
        return digest.hexdigest()

    def changed(self) -> bool:
        current = self._fingerprint()
        if current == self.fingerprint:
            return False
        self.fingerprint = current
        return True


def nvml_source_of(sources: Sequence[Source]) -> NvmlSource | None:
    """The NVML source among `sources`, found without importing its module: where that module was never
    loaded, no NvmlSource exists."""
    module = sys.modules.get("agent.sources.nvml")
    if module is None:
        return None
    nvml_type: type[NvmlSource] = module.NvmlSource
    return next((source for source in sources if isinstance(source, nvml_type)), None)


@cache
def catalog_xids() -> frozenset[int]:
    """The Xid codes of NVIDIA's catalog as shipped with the package (agent/data/xid_catalog.csv)."""
    text = (resources.files("agent") / "data" / "xid_catalog.csv").read_text(encoding="utf-8")
    return frozenset(int(row["xid"]) for row in csv.DictReader(text.splitlines()))


class Daemon:
    """Wires sources, pipeline, journal, metrics and HTTP; `run` returns when `stop` is set."""

    def __init__(
        self,
        config: Config,
        *,
        rules: RuleSet,
        sources: Sequence[Source] | None = None,
        extra_sources: Sequence[Source] = (),
        inventory: NodeInventory | None = None,
        registry: CollectorRegistry | None = None,
        journal: Journal | None = None,
        clock: Callable[[], float] = time.time,
        reload_seconds: float = 5.0,
        cluster: ClusterSide | None = None,
        cluster_of: Callable[[NodeHooks], ClusterSide] | None = None,
    ) -> None:
        """`cluster_of` builds the cluster side once the sources are known, handing it what it reads from them
        (NVML's processes, the reset procedure, the pods for the fleet summary); `cluster` is one built already
        (tests), used as it is."""
        self.config = config
        self.metrics = Metrics(registry or CollectorRegistry())
        self.journal = journal if journal is not None else Journal(config.journal_path)
        self.probes: list[SourceProbe] = []
        self.cluster = cluster  # before the sources: the kernel-log source reads the pod owners through it
        if sources is None:
            self.probes = discover_sources(SourceContext(config, self.journal, self._count,
                                                                owners=self._pod_owners, node_labels=self._node_labels))
            sources = [p.source for p in self.probes if p.source is not None]
        self.sources = [*sources, *extra_sources]
        self.nvml = nvml_source_of(self.sources)
        if cluster_of is not None:
            self.cluster = cluster = cluster_of(self._node_hooks(config))
        if not self.sources:
            reasons = "; ".join(f"{p.name}: {p.why_not}" for p in self.probes) or "none configured"
            self.journal.close()
            raise AgentError(f"no source available on this machine ({reasons}); "
                             "--scenario NAME replays a fault scenario instead")
        self.clock = clock
        #: Between the sources and the engine: folds repeats in a storm, never drops a new kind of fault.
        self.backlog = Backlog(capacity=BACKLOG_CAPACITY)
        self.metrics.watch_backlog(self.backlog)
        self.rules_dir = rules_dir_of(config)
        self.watcher = RulesWatcher(self.rules_dir)
        self.reload_seconds = reload_seconds
        self.pipeline = pipeline_of(config, rules=rules, inventory=inventory or NodeInventory(name=config.node_name),
                                    cluster=cluster, journal=self.journal, metrics=self.metrics, clock=clock,
                                    inline=False, on_released=self._forget_released)
        if self.journal.recreated:
            log.error("journal_recreated", reason=self.journal.recreated)
            self.metrics.journal_recreated.inc()
            note = Step(StepKind.EVENT, config.node_name, self.journal.recreated,
                        details=frozen_attrs({"reason": "JournalRecreated", "type": "Warning"}))
            self.pipeline.record.owe(OwedEvent.of(note, salt=str(clock())))
        if cluster is not None and self.pipeline.fresh:
            # No record in the journal (first start, or it was lost): the Node's copy, before any source
            # runs, so the kernel log resumes where the last agent acknowledged it. Bounded: a hung API
            # server must not keep detection from starting (the reconciler adopts it later).
            reader = threading.Thread(target=self.pipeline.start, name="record-from-node", daemon=True)
            reader.start()
            reader.join(timeout=START_WAIT_SECONDS)
        self.metrics.rules_loaded.set(len(rules.rules))
        self.heartbeat = clock()
        self._threads: list[threading.Thread] = []
        self._running: dict[str, bool] = {}
        self._finished: set[str] = set()

    def _node_hooks(self, config: Config) -> NodeHooks:
        """What the cluster side reads from this node's side, each read when it is called."""
        from agent.cluster_side import NodeHooks  # noqa: PLC0415 - the Kubernetes edge only where there is a cluster
        from agent.fleet.summariser import NodeFacts  # noqa: PLC0415 - the fleet summary only where there is a cluster
        from agent.gpu.reset import ResetProcedure  # noqa: PLC0415 - resets only where there is a cluster

        nvml = self.nvml
        # NVML's PIDs are the host's: charged through the host's /proc, as the kernel log's are.
        host_proc = Path(config.sources.kmsg.proc_root)

        def reset_of(operands: OperandPauser) -> ResetProcedure:
            # The GPU edge's reset procedure: the operands paused through this node's writer, the agent's own
            # NVML session released around the reset, the privileged part in the reset container.
            return ResetProcedure(reset_executor_of(config), operands=operands, nvml=nvml)

        def facts() -> NodeFacts:
            labels = self._node_labels()  # the Node's topology labels: what a scoped rack or zone hold is judged by
            return NodeFacts(driver_version=getattr(nvml, "driver_version", ""),
                             fabric_domain=getattr(nvml, "fabric_domain", ""),
                             rack=labels.get(config.remediation.rack_label, ""),
                             zone=labels.get(config.remediation.zone_label, ""))

        return NodeHooks(
            gpus_by_pod_uid=(lambda: gpus_by_pod_uid(nvml.pids_by_gpu(), host_proc)) if nvml is not None else None,
            mig_parents=nvml.mig_parents if nvml is not None else None,
            pods=lambda: self.pipeline.inventory.pods,
            facts=facts,
            reset_of=reset_of,
            # the rules loaded at the call: a hot reload swaps the pipeline's RuleSet
            rule_class=lambda rule_id: self.pipeline.rules.fault_class_of(rule_id),  # noqa: PLW0108
            on_fleet_set_aside=lambda what: self.metrics.fleet_set_aside.labels(what).inc(),
        )

    def _restore_operands(self) -> None:
        """Once a pass: operands a reset paused and did not restore (a crash, a failed restore) come back.

        The reset procedure's own lock keeps this from racing a running reset; it never raises.
        """
        if self.cluster is None:
            return
        from agent.gpu.reset import ResetProcedure  # noqa: PLC0415 - resets only where there is a cluster

        reset = self.cluster.actuator.reset
        if isinstance(reset, ResetProcedure):
            done = reset.restore_if_needed()
            if done:
                log.warning("operands_restore", result=done)

    def _forget_released(self, verdict: Verdict) -> None:
        """An operator released a missing GPU: NVML forgets it, so the next poll does not raise it again."""
        if self.nvml is not None and verdict.rule_id in GPU_MISSING_RULES and verdict.gpu is not None \
                and (verdict.gpu.uuid or verdict.gpu.pci_bus_id):
            self.nvml.forget_gpu(verdict.gpu.uuid, pci_bus_id=verdict.gpu.pci_bus_id)

    def _pod_owners(self) -> Mapping[str, str]:
        """The workload of each pod on this node, as the cluster side's last pod listing saw it."""
        return self.cluster.pods.owners if self.cluster is not None else {}

    def _node_labels(self) -> Mapping[str, str]:
        """The labels of this node's Node as the cluster side last saw it (GFD's among them)."""
        node = self.cluster.writer.seen.node if self.cluster is not None else None
        labels = ((node or {}).get("metadata") or {}).get("labels") or {}
        return {str(k): str(v) for k, v in labels.items()}

    def _count(self, source: str, name: str, amount: int) -> None:
        if name == "lost":
            self.metrics.kmsg_records_lost.inc(amount)
        elif name == "forged":
            self.metrics.kmsg_forged.inc(amount)
        elif name == "unreadable":
            self.metrics.kmsg_unreadable.inc(amount)
            self.metrics.source_errors.labels(source).inc(amount)
        else:
            self.metrics.source_errors.labels(source).inc(amount)

    def health(self) -> tuple[bool, dict[str, object]]:
        age = self.clock() - self.heartbeat
        running = sorted(name for name, up in self._running.items() if up or name in self._finished)
        failing = sorted(s.name for s in self.sources if getattr(s, "failing", False))
        journal = self.pipeline.journal_failing
        ok = age < max(30.0, 5 * self.config.tick_seconds) and bool(running) and not failing
        # Journal writes failing (a full disk) make the agent unready, not dead: a restart frees no space, and
        # a pod restarting in a loop would lose what it holds in memory.
        return ok, {"loop_age_seconds": round(age, 3), "sources": running, "failing_sources": failing,
                    "ready": not journal,
                    "journal_failing": "; ".join(f"{kind}: {error}" for kind, error in sorted(journal.items())),
                    "mode": str(self.config.mode), "dry_run": self.config.dry_run,
                    "backlog_depth": self.backlog.depth}

    def emit(self, observation: Observation) -> None:
        if not self.backlog.put(observation):  # only a new kind past twice the capacity: counted, never silent
            self.metrics.source_errors.labels(observation.source).inc()

    def missing_loud_sources(self) -> list[SourceProbe]:
        """The auto-detected sources that matter too much to leave out quietly (the kernel log) and cannot run."""
        return [p for p in self.probes if p.source is None and p.name in LOUD_WHEN_MISSING
                and p.why_not != DISABLED_IN_CONFIG]

    def run(self, stop: threading.Event) -> None:
        log.info("agent_starting", node=self.config.node_name, mode=str(self.config.mode),
                 dry_run=self.config.dry_run, sources=[s.name for s in self.sources],
                 rules=len(self.pipeline.rules.rules), local_mode=self.cluster is None,
                 storm_path=describe_storm_path())
        for probe in self.missing_loud_sources():
            log.warning("source_not_running", source=probe.name, reason=probe.why_not)
        for source in self.sources:
            self._start(f"source-{source.name}", self._run_source, source, stop)
        reconciler = threading.Thread(target=self._reconcile_loop, args=(stop,), name="reconciler", daemon=True)
        reconciler.start()
        node_watch = self.cluster.node_watch if self.cluster is not None else None
        if node_watch is not None:  # a change to the Node's inputs (a release, the opt-out) wakes a pass
            self._start("node-watch", node_watch.run, stop, self.pipeline.wake.set)
        claims_watch = self.cluster.claims_watch if self.cluster is not None else None
        if claims_watch is not None:  # the brake ranks a new claim from it, without a list
            self._start("claims-watch", claims_watch.run, stop)
        next_reload = self.clock() + self.reload_seconds
        next_prune = self.clock() + JOURNAL_PRUNE_SECONDS
        while not stop.is_set():
            self._drain(timeout=self.config.tick_seconds, stop=stop)
            self._safe_step("tick_failed", self.pipeline.tick)
            self.heartbeat = self.clock()
            if self.clock() >= next_reload:
                self.reload_rules_if_changed()
                next_reload = self.clock() + self.reload_seconds
            if self.clock() >= next_prune:
                self._safe_step("journal_prune_failed", self.journal.prune)
                next_prune = self.clock() + JOURNAL_PRUNE_SECONDS
        self.pipeline.wake.set()
        for watch in (node_watch, claims_watch):
            if watch is not None:
                watch.close()
        deadline = time.monotonic() + SHUTDOWN_SECONDS
        for thread in [*self._threads, reconciler]:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._drain(timeout=0, stop=None)
        if reconciler.is_alive():
            # An API call still hangs: what it did not apply is in the journal for the next agent.
            log.warning("reconciler_abandoned", reason="an API call did not return before shutdown")
        self.journal.close()
        log.info("agent_stopped", node=self.config.node_name)

    def _start(self, name: str, target: Callable[..., object], *args: object) -> None:
        """`target(*args)` on a daemon thread of its own, joined at shutdown."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _reconcile_loop(self, stop: threading.Event) -> None:
        """Converge the node to the durable record on every change and whenever a pass is due."""
        while not stop.is_set():
            self._safe_step("operands_restore_failed", self._restore_operands)
            self._safe_step("reconcile_failed", self.pipeline.reconcile)
            self.pipeline.wake.wait(timeout=max(0.05, self.pipeline.due_at - self.clock()))
            self.pipeline.wake.clear()

    def _drain(self, *, timeout: float, stop: threading.Event | None) -> None:
        """Handle queued observations until `timeout` has passed (the loop then ticks and beats, even in a storm
        that keeps the backlog full); with no `stop`, until the backlog is empty."""
        deadline = self.clock() + timeout
        while True:
            observations = self.backlog.get_many(DRAIN_BATCH, timeout=max(0.0, deadline - self.clock()))
            if not observations:
                return
            for observation in observations:  # all of them: what was taken from the backlog is never dropped
                self._safe_step("observation_failed", self.pipeline.handle, observation)
            if stop is not None and (stop.is_set() or self.clock() >= deadline):
                return

    def _safe_step(self, event: str, func: Callable[..., object], *args: object) -> None:
        try:
            func(*args)
        except Exception as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
            log.error(event, error=f"{type(exc).__name__}: {exc}")

    def reload_rules_if_changed(self) -> bool:
        """Swap in a changed rules directory if it is valid and loses nothing (engine/reload.py); otherwise
        keep the rules in force."""
        if not self.watcher.changed():
            return False
        try:
            rules = load_rules(self.rules_dir)
        except InputErrors as exc:
            self.metrics.rules_reload_failures.inc()
            for problem in exc.problems:
                log.error("rules_reload_rejected", problem=problem.line())
            return False
        refused = refusal(self.pipeline.rules, rules, catalog=catalog_xids())
        if refused is not None:
            self.metrics.rules_reload_failures.inc()
            self.metrics.rules_reload_refused.labels(refused.reason).inc()
            log.error("rules_reload_refused", reason=refused.reason, lost=len(refused.missing),
                      missing=", ".join(refused.missing[:NAMED]) + (" ..." if len(refused.missing) > NAMED else ""),
                      running=len(self.pipeline.rules.rules), candidate=len(rules.rules), fix=refused.fix,
                      directory=str(self.rules_dir))
            return False
        self.pipeline.replace_rules(rules)
        log.info("rules_reloaded", rules=len(rules.rules), directory=str(self.rules_dir))
        return True

    def _run_source(self, source: Source, stop: threading.Event) -> None:
        """Run a source, restarting it with backoff when it fails; its failure never reaches the others."""
        failures = 0
        while not stop.is_set():
            self._running[source.name] = True
            self.metrics.source_up.labels(source.name).set(1)
            try:
                source.run(self.emit, stop)
                failures = 0
                if not stop.is_set():
                    log.info("source_finished", source=source.name)
                    self._finished.add(source.name)
                    break
            except Exception as exc:  # noqa: BLE001 - isolation: one failure must not stop the rest
                failures += 1
                self.metrics.source_errors.labels(source.name).inc()
                log.error("source_failed", source=source.name, error=f"{type(exc).__name__}: {exc}",
                          failures=failures)
            finally:
                self._running[source.name] = False
                self.metrics.source_up.labels(source.name).set(0)
            stop.wait(min(60.0, 2.0 ** min(failures, 6)))
