"""Node 0's supervisor process: the job coordinator and node 0's agent, side by side.

Started by node 0's launcher (``python -m ftrun.node.supervisor``), it reads its
:class:`~ftrun.config.JobSpec` from the environment, builds node 0's
:class:`~ftrun.node.spawner.RankProcesses` behind a :class:`~ftrun.coordinator.agents.LocalAgent`, and runs the
:class:`~ftrun.coordinator.Coordinator` to the job's end. Its exit code is the job's. Node 0's
ranks are its children (tied to its life by ``PR_SET_PDEATHSIG``); other nodes run
``python -m ftrun.node.agent``. Beside the coordinator it records the ranks' progress for ``ftrun
report`` (:class:`~ftrun.tools.report.ProgressRecorder`) and, with ``--metrics_port``, serves Prometheus
metrics fed by the coordinator's events (:mod:`ftrun.coordinator.metrics`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ftrun.common import procs
from ftrun.coordinator.agents import LocalAgent
from ftrun.config import JobSpec
from ftrun.coordinator import Coordinator
from ftrun.tools.report import ProgressRecorder
from ftrun.node.spawner import RankProcesses, rank_argv

log = logging.getLogger("ftrun.node.supervisor")


def main() -> None:
    """Entry point of ``python -m ftrun.node.supervisor`` (started by the launcher, not by users)."""
    spec = JobSpec.from_json(json.loads(os.environ["FTRUN_SUPERVISOR_SPEC"]))
    procs.dump_stacks_on_sigusr1()  # into supervisor.log, its stderr
    log_dir = Path(spec.log_dir)
    logging.basicConfig(
        filename=log_dir / "supervisor.log",
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    store_fd = os.environ.pop("FTRUN_STORE_FD", None)  # a store's socket (the job's or the node's record store), to host
    processes = RankProcesses(
        rank_argv(spec.no_python, spec.module, spec.script, list(spec.script_args)),
        [spec.script, *spec.script_args], spec.module, log_dir, spec.local_worker_num, spec.master_addr,
        multi_node=spec.nnodes > 1, token=os.environ["FTRUN_TOKEN_FOR_SUPERVISOR"],
        fork_server=getattr(spec, "fork_server", "off") == "on",
        store=(int(store_fd), spec.cluster_time_out) if store_fd else None,
    )
    metrics, spec = start_job_metrics(spec)
    logging.raiseExceptions = False  # a full or removed log directory: the log loses lines, the job goes on
    coordinator = Coordinator(
        spec,
        token=os.environ["FTRUN_TOKEN_FOR_SUPERVISOR"],
        events_addr=os.environ.get("FTRUN_EVENTS_ADDR"),
        store_port=int(os.environ["FTRUN_STORE_PORT"]),
        local_agent=LocalAgent(0, processes),
    )
    progress = ProgressRecorder(log_dir)  # every rank's step over time, for ftrun report --plot
    if metrics is not None:
        coordinator.observers.append(metrics.observe)
        progress.listeners.append(metrics.add_sample)
    progress.start()
    try:
        code = coordinator.run()
    except BaseException:
        log.exception("supervisor crashed")
        raise
    finally:
        progress.close()
    logging.shutdown()
    sys.exit(code)


def start_job_metrics(spec: JobSpec) -> tuple[Any, JobSpec]:
    """Serve Prometheus metrics when ``--metrics_port`` asks for them (prometheus_client is imported
    only then). A port taken since the CLI checked it costs the metrics, not the job: the spec comes
    back with a warning that the job's first events show. Returns (the metrics or None, the spec)."""
    if not getattr(spec, "metrics_port", 0):
        return None, spec
    from ftrun.coordinator.metrics import MetricsError, metrics_bind_address, start_metrics

    addr = metrics_bind_address(spec.metrics_addr, spec.master_addr, spec.nnodes)
    try:
        metrics, _server = start_metrics(Path(spec.log_dir), spec.metrics_port, addr)
    except MetricsError as err:
        return None, dataclasses.replace(spec, warnings=(*spec.warnings, f"no metrics: {err}"))
    log.info("metrics on http://%s:%d/metrics", addr, spec.metrics_port)
    return metrics, spec


if __name__ == "__main__":
    main()
