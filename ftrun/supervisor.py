"""Node 0's supervisor process: the job coordinator and node 0's agent, side by side.

Started by node 0's launcher (``python -m ftrun.supervisor``), it reads its
:class:`~ftrun.config.JobSpec` from the environment, builds node 0's
:class:`~ftrun.spawner.RankProcesses` behind a :class:`~ftrun.agent.LocalAgent`, and runs the
:class:`~ftrun.coordinator.Coordinator` to the job's end. Its exit code is the job's. Node 0's
ranks are its children (tied to its life by ``PR_SET_PDEATHSIG``); other nodes run
``python -m ftrun.agent``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from .agent import LocalAgent
from .config import JobSpec
from .coordinator import Coordinator
from .spawner import RankProcesses, rank_argv

log = logging.getLogger("ftrun.supervisor")


def main() -> None:
    """Entry point of ``python -m ftrun.supervisor`` (started by the launcher, not by users)."""
    spec = JobSpec.from_json(json.loads(os.environ["FTRUN_SUPERVISOR_SPEC"]))
    log_dir = Path(spec.log_dir)
    logging.basicConfig(
        filename=log_dir / "supervisor.log",
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    processes = RankProcesses(
        rank_argv(spec.no_python, spec.module, spec.script, list(spec.script_args)),
        [spec.script, *spec.script_args], spec.module, log_dir, spec.local_worker_num, spec.master_addr,
        multi_node=spec.nnodes > 1,
    )
    coordinator = Coordinator(
        spec,
        token=os.environ["FTRUN_TOKEN_FOR_SUPERVISOR"],
        events_addr=os.environ.get("FTRUN_EVENTS_ADDR"),
        store_port=int(os.environ["FTRUN_STORE_PORT"]),
        local_agent=LocalAgent(0, processes),
    )
    try:
        code = coordinator.run()
    except BaseException:
        log.exception("supervisor crashed")
        raise
    logging.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    main()
