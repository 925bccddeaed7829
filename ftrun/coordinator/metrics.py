"""Prometheus metrics of a job, served by the coordinator's process on ``--metrics_port``.

Off by default (``--metrics_port 0``): then this module is not even imported. When on, the
supervisor (node 0) serves ``http://ADDR:PORT/metrics`` in the standard text format from
``prometheus_client``'s HTTP server thread, with a private :class:`~prometheus_client.CollectorRegistry`
(nothing of the process's own, nothing another library registered globally). ADDR is
``--metrics_addr``, by default 127.0.0.1 for a single-node job whose master address is a loopback
one, else the address the store listens on (:func:`ftrun.common.stores.bind_host`): a job's metrics are
not offered to the network unless the job already is.

Two sources, neither of which slows the coordinator's loop:

- events, through the coordinator's observer list (:meth:`JobMetrics.observe`, a few counter and
  histogram updates per event; events are rare): recoveries by kind, failures, restarts, recovery,
  detection and checkpoint times, checkpoint bytes, and the goodput timeline, which also takes the
  progress recorder's samples (:meth:`JobMetrics.add_sample`, from the recorder's thread);
- ``LOG_DIR/status.json``, read when Prometheus scrapes (by :class:`StatusCollector`): every rank's
  state, step, step time and restarts, and the job's step and total.

Metric names (all ``ftrun_``; per-rank ones carry ``rank`` and ``node`` labels):

================================  =========  ====================================================
``ftrun_rank_state``              gauge      1 for the rank's state (``state`` label), 0 for the others
``ftrun_rank_step``               gauge      the step the rank runs
``ftrun_rank_step_seconds``       gauge      its latest step time, seconds
``ftrun_rank_restarts_total``     counter    processes that replaced it (respawns and restarts)
``ftrun_job_step``                gauge      the job's step (lowest over ranks)
``ftrun_job_total_steps``         gauge      the steps the job runs (when the ranks say)
``ftrun_job_restarts_used``       gauge      restart budget used (``ftrun_job_max_restarts``: all of it)
``ftrun_job_recovering``          gauge      1 while a recovery is under way
``ftrun_job_attempt``             gauge      whole-job attempt (0 first)
``ftrun_job_up``                  gauge      1 while running, 0 once finished
``ftrun_goodput_ratio``           gauge      share of wall time on steps that count (see ftrun.tools.report)
``ftrun_wall_seconds``            gauge      wall time so far
``ftrun_lost_seconds``            gauge      wall time lost to faults so far
``ftrun_startup_seconds``         gauge      wall time before the first step
``ftrun_recoveries_total``        counter    recoveries, by the ``fault`` that began them (death, hang, comm_error, recoverable_error)
``ftrun_rank_failures_total``     counter    rank processes that failed
``ftrun_job_restarts_total``      counter    whole-job restarts
``ftrun_recovery_seconds``        histogram  a recovery's time from the fault to training again
``ftrun_recovery_phase_seconds``  histogram  its split, by ``phase`` (detection, respawn, rebuild, transfer)
``ftrun_detection_seconds``       histogram  a failure's evidence to the coordinator acting on it
``ftrun_checkpoint_seconds``      histogram  writing a checkpoint
``ftrun_checkpoint_bytes_total``  counter    bytes of completed checkpoints
``ftrun_checkpoint_step``         gauge      the step of the newest checkpoint
================================  =========  ====================================================
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ftrun.tools.report import STATUS_FILE, JobTimeline, job_steps_done, job_total_steps

#: The rank states (``ftrun.coordinator.policy.RankState``'s values), each a label value of ftrun_rank_state.
RANK_STATES = ("starting", "healthy", "recovering", "succeeded", "failed", "stopped")
#: Histogram buckets for recovery and detection times, seconds (a recovery takes 0.1 s to minutes).
RECOVERY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
#: Histogram buckets for checkpoint writes, seconds.
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)


class MetricsError(Exception):
    """The metrics endpoint cannot be served (its port is taken, its address is not this host's)."""


def _read_status(log_dir: Path) -> dict[str, Any] | None:
    """This process's job's status.json (a file left by an earlier run in the same log directory,
    which names another supervisor pid, is not this job's), or None."""
    try:
        status = json.loads((log_dir / STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) and status.get("pid") == os.getpid() else None


class JobMetrics:
    """Every metric of one job, in a private registry.

    Args:
        log_dir: the job's log directory (its ``status.json`` is read at each scrape).
        status_source: returns the current status snapshot, or None (default: read status.json).
        clock: Unix time, seconds.

    Thread safety: :meth:`observe` runs in the coordinator's thread and scrapes in the HTTP
    server's; the goodput timeline they share is guarded by a lock (prometheus_client's own
    metrics are thread-safe).
    """

    def __init__(self, log_dir: Path, status_source: Callable[[], dict[str, Any] | None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.log_dir = Path(log_dir)
        self.status_source = status_source or (lambda: _read_status(self.log_dir))
        self.clock = clock
        self.timeline = JobTimeline()
        self.lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.recoveries = Counter("ftrun_recoveries", "Recoveries started, by the fault that started them.",
                                  ["fault"], registry=r)
        # A recovery begun on a communication error whose next round respawns ranks was begun by
        # their death (the survivors' report can beat the SIGCHLD by milliseconds): its kind is
        # counted once its next round or its end says which.
        self._open_fault: str | None = None
        self.failures = Counter("ftrun_rank_failures", "Rank processes that failed (died, or killed as hung).",
                                registry=r)
        self.restarts = Counter("ftrun_job_restarts", "Whole-job restarts.", registry=r)
        self.node_losses = Counter("ftrun_node_losses", "Nodes lost (every process of a node, or its host), by how "
                                   "the loss was seen.", ["cause"], registry=r)
        self.takeovers = Counter("ftrun_coordinator_takeovers", "Times a standby coordinator took the job over "
                                 "(the coordinator's node was lost).", registry=r)
        self.recovery_seconds = Histogram("ftrun_recovery_seconds", "A recovery's time from the fault to training "
                                          "again, seconds.", buckets=RECOVERY_BUCKETS, registry=r)
        self.phase_seconds = Histogram("ftrun_recovery_phase_seconds", "A recovery's time split by phase, seconds.",
                                       ["phase"], buckets=RECOVERY_BUCKETS, registry=r)
        self.detection_seconds = Histogram("ftrun_detection_seconds", "From a failure's evidence (SIGCHLD, the last "
                                           "heartbeat or progress) to the coordinator acting, seconds.",
                                           buckets=RECOVERY_BUCKETS, registry=r)
        self.checkpoint_seconds = Histogram("ftrun_checkpoint_seconds", "Writing a checkpoint, seconds.",
                                            buckets=CHECKPOINT_BUCKETS, registry=r)
        self.checkpoint_bytes = Counter("ftrun_checkpoint_bytes", "Bytes of completed checkpoints.", registry=r)
        self.checkpoint_step = Gauge("ftrun_checkpoint_step", "The step of the newest completed checkpoint.",
                                     registry=r)
        for fault in ("death", "node_loss", "hang", "comm_error", "recoverable_error"):
            self.recoveries.labels(fault=fault)  # every kind shows, at 0, before it first happens
        for cause in ("connection_closed", "silent", "left", "not_joined", "replaced", "coordinator_lost"):
            self.node_losses.labels(cause=cause)
        for phase in ("detection", "node_wait", "respawn", "rebuild", "transfer"):
            self.phase_seconds.labels(phase=phase)
        r.register(StatusCollector(self))

    # ---------------------------------------------------------------- events
    def _on_round(self, detail: dict[str, Any]) -> None:
        """A recovery round: count its recovery's fault, at once unless it respawns nothing."""
        fault = str(detail.get("fault") or "death")
        if "round" not in detail:
            if fault in ("comm_error", "recoverable_error") and not detail.get("failed"):
                self._open_fault = fault
            else:
                self.recoveries.labels(fault=fault).inc()
        elif self._open_fault is not None and detail.get("failed"):
            self.recoveries.labels(fault=fault).inc()  # a death (or hang) restarted it: that began it
            self._open_fault = None

    def observe(self, event: Any) -> None:
        """The coordinator's event observer: takes an :class:`~ftrun.common.events.Event` or its JSON dict."""
        data = event.to_json() if hasattr(event, "to_json") else event
        kind = data.get("kind")
        detail = data.get("detail") or {}
        with self.lock:
            self.timeline.add(data)
        if kind == "recovery_started":
            self._on_round(detail)
        elif kind in ("recovery_finished", "job_restarting", "job_finished") and self._open_fault is not None:
            self.recoveries.labels(fault=self._open_fault).inc()
            self._open_fault = None
        if kind == "rank_failed":
            self.failures.inc()
            if _number(detail.get("detection_seconds")):
                self.detection_seconds.observe(float(detail["detection_seconds"]))
        elif kind == "job_restarting":
            self.restarts.inc()
        elif kind == "node_lost":
            self.node_losses.labels(cause=str(detail.get("cause") or "silent")).inc()
        elif kind == "coordinator_takeover":
            self.takeovers.inc()
        elif kind == "recovery_finished":
            if _number(detail.get("total_seconds")):
                self.recovery_seconds.observe(float(detail["total_seconds"]))
            respawn = detail.get("respawn_seconds")
            node_wait = detail.get("node_wait_seconds")
            phases = {
                "detection": detail.get("detection_seconds"),
                "node_wait": max((v for v in node_wait.values() if _number(v)), default=None) if isinstance(node_wait, dict) else None,
                "respawn": max((v for v in respawn.values() if _number(v)), default=None) if isinstance(respawn, dict) else None,
                "rebuild": detail.get("rebuild_seconds"),
                "transfer": detail.get("transfer_seconds"),
            }
            for phase, value in phases.items():
                if _number(value):
                    self.phase_seconds.labels(phase=phase).observe(float(value))
        elif kind == "checkpoint_saved":
            if _number(detail.get("seconds")):
                self.checkpoint_seconds.observe(float(detail["seconds"]))
            if _number(detail.get("bytes")):
                self.checkpoint_bytes.inc(float(detail["bytes"]))
            if _number(detail.get("step")):
                self.checkpoint_step.set(float(detail["step"]))

    def add_sample(self, sample: Any) -> None:
        """A progress sample (:class:`ftrun.tools.report.Sample`, from the progress recorder's thread):
        the goodput's first step and the end of a whole-job restart's lost time."""
        with self.lock:
            self.timeline.add_sample(sample)

    # ---------------------------------------------------------------- scrape
    def render(self) -> bytes:
        """The registry in Prometheus's text format (what ``/metrics`` returns)."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str) -> Any:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread.

        Returns:
            the HTTP server (``server.server_port`` is the port; ``server.shutdown()`` stops it).

        Raises:
            MetricsError: the port is taken or the address is not this host's.
        """
        from prometheus_client import start_http_server

        try:
            result = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as err:
            raise MetricsError(_bind_problem(addr, port, err)) from None
        return result[0] if isinstance(result, tuple) else result


class StatusCollector(Collector):
    """The metrics read from the job's status snapshot when Prometheus scrapes."""

    def __init__(self, metrics: JobMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # dynamic: described by collecting

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        status = m.status_source()
        now = m.clock()
        state = GaugeMetricFamily("ftrun_rank_state", "1 for the rank's current state, 0 for the others.",
                                  labels=["rank", "node", "state"])
        step = GaugeMetricFamily("ftrun_rank_step", "The step the rank runs.", labels=["rank", "node"])
        step_s = GaugeMetricFamily("ftrun_rank_step_seconds", "The rank's latest step time, seconds.",
                                   labels=["rank", "node"])
        restarts = CounterMetricFamily("ftrun_rank_restarts", "Processes that replaced the rank (respawns and "
                                       "whole-job restarts).", labels=["rank", "node"])
        job = {name: GaugeMetricFamily(f"ftrun_{name}", text) for name, text in (
            ("job_step", "The job's step: the lowest step over its ranks."),
            ("job_total_steps", "The number of steps the job runs, when its ranks say."),
            ("job_restarts_used", "Restart budget used (respawned ranks and whole-job restarts)."),
            ("job_max_restarts", "The restart budget (--max_restarts)."),
            ("job_recovering", "1 while a recovery is under way."),
            ("job_attempt", "The whole-job attempt (0: the first)."),
            ("job_up", "1 while the job runs, 0 once it has finished."),
            ("goodput_ratio", "Share of wall time spent on steps that count (see ftrun.tools.report)."),
            ("wall_seconds", "Wall time since the job started, seconds."),
            ("lost_seconds", "Wall time lost to faults so far, seconds."),
            ("startup_seconds", "Wall time before the first step, seconds."),
        )}
        if status is not None:
            rows = [r for r in status.get("ranks") or [] if isinstance(r, dict) and isinstance(r.get("rank"), int)]
            for row in rows:
                labels = [str(row["rank"]), str(row.get("node", 0))]
                for name in RANK_STATES:
                    state.add_metric([*labels, name], 1.0 if row.get("state") == name else 0.0)
                if _number(row.get("step")):
                    step.add_metric(labels, float(row["step"]))
                if _number(row.get("last_step_seconds")):
                    step_s.add_metric(labels, float(row["last_step_seconds"]))
                if _number(row.get("restarts")):
                    restarts.add_metric(labels, float(row["restarts"]))
            done = job_steps_done(rows)
            if done is not None:
                job["job_step"].add_metric([], float(done))
            total = job_total_steps(rows)
            if total is not None:
                job["job_total_steps"].add_metric([], float(total))
            for name, key in (("job_restarts_used", "restarts_used"), ("job_max_restarts", "max_restarts"),
                              ("job_attempt", "attempt")):
                if _number(status.get(key)):
                    job[name].add_metric([], float(status[key]))
            job["job_recovering"].add_metric([], 1.0 if status.get("recovering") else 0.0)
            job["job_up"].add_metric([], 1.0 if status.get("state") == "running" else 0.0)
        with m.lock:
            good = m.timeline.goodput(now) if m.timeline.started_at is not None else None
        if good is not None:
            if good.ratio is not None:
                job["goodput_ratio"].add_metric([], good.ratio)
            job["wall_seconds"].add_metric([], good.wall)
            job["lost_seconds"].add_metric([], good.lost)
            job["startup_seconds"].add_metric([], good.startup)
        yield from (state, step, step_s, restarts, *job.values())


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bind_problem(addr: str, port: int, err: OSError) -> str:
    if err.errno == errno.EADDRINUSE:
        return f"--metrics_port {port} is already in use on {addr}; pick a free port"
    if err.errno == errno.EADDRNOTAVAIL:
        return f"--metrics_addr {addr} is not an address of this host; give one of its addresses (or leave it out)"
    return f"cannot serve metrics on {addr}:{port}: {err.strerror or err}"


def check_endpoint(addr: str, port: int) -> None:
    """Fail early (in the CLI, before any rank starts) when ``addr:port`` cannot be bound.

    Raises:
        MetricsError: the port is taken or the address is not this host's.
    """
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
        except OSError as err:
            raise MetricsError(_bind_problem(addr, port, err)) from None


def metrics_bind_address(metrics_addr: str | None, master_addr: str, nnodes: int) -> str:
    """Where the metrics endpoint listens: ``--metrics_addr`` when given, else where the job's store
    listens (127.0.0.1 for a single-node job with a loopback master address; see
    :func:`ftrun.common.stores.bind_host`)."""
    if metrics_addr:
        return metrics_addr
    from ftrun.common.stores import bind_host

    return bind_host(master_addr, nnodes)


def start_metrics(log_dir: Path, port: int, addr: str) -> tuple[JobMetrics, Any]:
    """Build a job's metrics and serve them on ``addr:port``.

    Returns:
        (the metrics, whose :meth:`JobMetrics.observe` is the coordinator's observer; the server).

    Raises:
        MetricsError: the endpoint cannot be served.
    """
    metrics = JobMetrics(log_dir)
    return metrics, metrics.serve(port, addr)
