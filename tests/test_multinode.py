"""Multi-node jobs on test hosts (network namespaces): one coordinator, one agent per node.

Each host runs its own ``ftrun`` launcher, as on a real cluster (``--node_rank``, ``--master_addr``
of host 0, a shared ``FTRUN_TOKEN``). No test sets ``GLOO_SOCKET_IFNAME``: inside a namespace the
host name resolves to 127.0.0.1, and ftrun must choose the interface that routes to node 0 itself.
The correctness bar is the single-node one: a faulted run ends with the parameters of the
fault-free run, and ranks that did not fault keep their PID.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import digits_job as dj
import psutil
import pytest
from reference_runs import TORCH_ABORT
from nethosts import NetHost, net_hosts  # noqa: F401
from example_jobs import EXAMPLES, MNIST_ARGS, final_digest, mnist_reference  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "multi-node-test-secret-" + "0" * 40


@dataclass
class NodeRun:
    host: NetHost
    proc: subprocess.Popen
    out_path: Path
    log_dir: Path

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")


def start_job(hosts: list[NetHost], tmp_path: Path, script: Path = dj.SCRIPT, steps: str = dj.STEPS, local: int = 2,
              fault: str | None = None, extra: tuple[str, ...] = (), script_args: tuple[str, ...] = ("--log_every", "10"),
              extra_env: dict[str, str] | None = None) -> list[NodeRun]:
    """One launcher per host, node i on host i; node 0's output and events carry the job's result."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    return [start_node(host, i, hosts[0].addr, len(hosts), tmp_path, script, steps, local, fault, extra, script_args,
                       extra_env, tag=str(i))
            for i, host in enumerate(hosts)]


def start_node(host: NetHost, node: int | None, master: str, nnodes: int, tmp_path: Path, script: Path = dj.SCRIPT,
               steps: str | None = dj.STEPS, local: int = 2, fault: str | None = None, extra: tuple[str, ...] = (),
               script_args: tuple[str, ...] = ("--log_every", "10"), extra_env: dict[str, str] | None = None,
               tag: str = "") -> NodeRun:
    """Start one node's launcher on ``host`` (a replacement too: the same command, another host;
    ``node`` None: no index, it takes one; ``steps`` None: the script takes no ``--steps``)."""
    env = dj.env({"FTRUN_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", **({"FTRUN_FAULT": fault} if fault else {}),
                  **(extra_env or {})})
    log_dir = tmp_path / f"logs{tag}"
    cmd = [sys.executable, "-m", "ftrun", "--worker_num", str(local * nnodes), "--local_worker_num", str(local),
           *(() if node is None else ("--node_rank", str(node))), "--master_addr", master, "--master_port", "29500", "--plain",
           "--log_dir", str(log_dir), "--checkpoint_dir", str(tmp_path / "ckpt"), "--max_restarts", "4",
           "--tail_worker_log", "0" if node in (0, None) else "", *extra, str(script), *(() if steps is None else ("--steps", steps)), *script_args]
    out_path = tmp_path / f"out{tag}.txt"
    with open(out_path, "wb") as out:
        proc = host.popen(cmd, env=env, cwd=str(tmp_path), stdout=out, stderr=subprocess.STDOUT)
    return NodeRun(host, proc, out_path, log_dir)


def wait_all(runs: list[NodeRun], timeout: float = 240.0) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for run in runs:
        try:
            codes.append(run.proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {runs.index(run)} did not end in time:\n" + "\n---\n".join(r.output()[-3000:] for r in runs))
    return codes


def run_job(hosts: list[NetHost], tmp_path: Path, **kw) -> tuple[str, list[dict], list[NodeRun]]:
    runs = start_job(hosts, tmp_path, **kw)
    codes = wait_all(runs)
    assert codes == [0] * len(runs), "\n---\n".join(r.output()[-3000:] for r in runs)
    steps = kw.get("steps", dj.STEPS)
    return dj.digest(runs[0].output(), steps), dj.events(runs[0].log_dir), runs


def kill_left(runs: list[NodeRun | None]) -> None:
    """SIGKILL the process group of every launcher in ``runs`` still running (None: one never started)."""
    for run in runs:
        if run is not None and run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)


def kill_host(host: NetHost) -> None:
    """SIGKILL every process on ``host`` (a host's death: its launcher, agent, fork server, stores, ranks)."""
    for pid in host.pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def all_pids(runs: list[NodeRun]) -> list[int]:
    """Every process a test started in the hosts (launchers and their descendants), still alive."""
    found = []
    for run in runs:
        found += [p for p in run.host.pids()]
    return found


def test_two_hosts_fault_free_matches_single_node(net_hosts, reference: str, tmp_path: Path) -> None:  # noqa: F811
    hosts = net_hosts(2)
    digest, events, runs = run_job(hosts, tmp_path)
    assert digest == reference
    assert {e["detail"].get("node") for e in events if e["kind"] == "rank_started"} == {0, 1}
    assert [e for e in events if e["kind"] == "node_joined"]
    # ftrun chose the data-plane interface itself (the host name resolves to loopback here)
    assert "GLOO_SOCKET_IFNAME=eth0" in runs[1].output()
    assert not [e for e in events if e["kind"] in ("rank_failed", "recovery_started", "job_restarting")]


def start_capture(host: NetHost, out: Path) -> subprocess.Popen:
    """A packet capture of ``host``'s link (tests/scripts/sniff.py in its namespace), ready when returned."""
    proc = host.popen([sys.executable, str(ROOT / "tests" / "scripts" / "sniff.py"), host.ifname, str(out)])
    dj.wait_for(lambda: Path(str(out) + ".ready").exists() or proc.poll() is not None, timeout=30)
    assert proc.poll() is None, "the packet capture did not start"
    return proc


def captured_frames(path: Path) -> list[bytes]:
    data, frames, at = path.read_bytes(), [], 0
    while at + 4 <= len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        frames.append(data[at + 4:at + 4 + size])
        at += 4 + size
    return frames


def test_kills_at_injection_points_on_the_last_node(net_hosts, reference: str, tmp_path: Path) -> None:  # noqa: F811
    """One job, one kill at each of the step's injection points on the last node's ranks (one
    after another: the work of four jobs in one), each recovered from a replica on node 0.

    Every frame on node 1's link is captured meanwhile (the respawns send node 1's agent the
    ranks' environment): the job's secret is in none of them."""
    hosts = net_hosts(2)
    capture = start_capture(hosts[1], tmp_path / "node1.pcap")
    try:
        digest, events, runs = run_job(hosts, tmp_path / "job", extra=RELAY, fault=(
            "rank=3,step=4,point=allreduce,kind=kill; rank=2,step=9,point=optimizer,kind=kill; "
            "rank=3,step=14,point=before_forward,kind=kill,incarnation=1; rank=2,step=19,point=between_steps,kind=kill,incarnation=1"))
    finally:
        capture.terminate()
        capture.wait(timeout=30)
    frames = captured_frames(tmp_path / "node1.pcap")
    # What the capture must have seen for its verdict to mean something: the spawn orders, with the
    # ranks' environment in them.
    assert any(b"spawn" in f for f in frames) and any(b"MASTER_ADDR" in f for f in frames), f"{len(frames)} frames, no spawn order"
    windows = {TOKEN[i:i + 16].encode() for i in range(0, len(TOKEN) - 15, 8)}
    leaks = [w for w in windows if any(w in f for f in frames)]
    assert not leaks, f"the job's secret crossed node 1's link: {leaks}"
    assert digest == reference
    dj.assert_survivors_kept_pids(events, {2, 3})
    assert [e["rank"] for e in events if e["kind"] == "rank_failed"] == [3, 2, 3, 2]
    # A survivor's failed collective can reach the coordinator before node 1's agent reports the
    # death: that round is then restarted before its plan, so there may be fewer plans than faults.
    # The killed ranks receive; so may a survivor on node 0 that had not yet committed the step a
    # faster replica committed (the plan's laggard rule: seen once, rank 0 behind rank 1 at step 9).
    plans = [e for e in events if e["kind"] == "recovery_planned"]
    recipients = {t[1] for p in plans for t in p["detail"]["transfers"]}
    assert plans and {2, 3} <= recipients, dj.story(events)
    assert_relayed(runs[1], rounds=False)  # the kills come before the agent has relayed a beat of each incarnation


def _signal_rank_on_node1(hosts: list[NetHost], tmp_path: Path, sig: int) -> tuple[str, list[dict]]:
    runs = start_job(hosts, tmp_path, steps=dj.LONG_STEPS)
    try:
        dj.wait_for(lambda: dj.training(runs[0].log_dir), timeout=180)
        pid = dj.started(dj.events(runs[0].log_dir))[2][0]
        os.kill(pid, sig)  # rank 2 runs on node 1 (pids are global on this machine)
        codes = wait_all(runs)
    finally:
        kill_left(runs)
    assert codes == [0, 0], "\n---\n".join(r.output()[-3000:] for r in runs)
    return dj.digest(runs[0].output(), dj.LONG_STEPS), dj.events(runs[0].log_dir)


def test_sigkill_from_outside_on_node1(net_hosts, long_reference: str, tmp_path: Path) -> None:  # noqa: F811
    digest, events = _signal_rank_on_node1(net_hosts(2), tmp_path, signal.SIGKILL)
    assert digest == long_reference
    dj.assert_survivors_kept_pids(events, {2})


def test_frozen_rank_on_node1(net_hosts, long_reference: str, tmp_path: Path) -> None:  # noqa: F811
    digest, events = _signal_rank_on_node1(net_hosts(2), tmp_path, signal.SIGSTOP)
    assert digest == long_reference
    dj.assert_survivors_kept_pids(events, {2})
    hung = [e for e in events if e["kind"] == "rank_hung"]
    assert [e["rank"] for e in hung] == [2] and hung[0]["detail"]["fault"] == "stopped"  # node 1's agent saw it


def test_new_rank_and_donor_killed_across_nodes(net_hosts, reference: str, tmp_path: Path) -> None:  # noqa: F811
    # Rank 3 (node 1) dies; its respawn dies while rejoining; the donor dies mid-transfer.
    hosts = net_hosts(2)
    digest, events, _ = run_job(
        hosts, tmp_path,
        fault="rank=3,step=8,kind=kill; rank=3,point=rejoin,incarnation=1,kind=kill; rank=0,point=transfer,kind=kill")
    assert digest == reference
    dj.assert_survivors_kept_pids(events, {0, 3})


def test_torchrun_script_restarts_on_every_node(net_hosts, tmp_path: Path) -> None:  # noqa: F811
    """An unmodified env:// script: a SIGKILL of a rank on node 1 restarts the job on both nodes
    (one coordinated whole-job restart, a fresh store), and it ends as without the fault."""
    hosts = net_hosts(2)
    script = ROOT / "examples" / "train_digits_torchrun.py"
    clean, _, _ = run_job(hosts, tmp_path / "clean", script=script, script_args=())
    runs = start_job(hosts, tmp_path / "faulted", script=script, script_args=())
    try:
        dj.wait_for(lambda: len(dj.started(dj.events(runs[0].log_dir))) == 4, timeout=120)
        victim = dj.started(dj.events(runs[0].log_dir))[3][0]
        os.kill(victim, signal.SIGKILL)
        codes = wait_all(runs)
    finally:
        kill_left(runs)
    events = dj.events(runs[0].log_dir)
    assert codes == [0, 0], "\n---\n".join(r.output()[-3000:] for r in runs)
    assert dj.digest(runs[0].output()) == clean
    restarts = [e for e in events if e["kind"] == "job_restarting"]
    # torch's own abort of a gloo rank (tests/reference_runs.py) is one more whole-job restart of a
    # plain script, as it would be under torchrun (seen once in CI: at the restarted attempt's start).
    torch_aborts = [p for run in runs for p in Path(run.log_dir).glob("worker_*.log") if TORCH_ABORT in p.read_text(errors="replace")]
    assert 1 <= len(restarts) <= 1 + len(torch_aborts), [e["message"] for e in events if e["kind"] == "rank_failed"]
    assert all(len(p) == 1 + len(restarts) for p in dj.started(events).values()), "every rank on every node restarts"


@pytest.mark.parametrize("node", [1, 0])
def test_launcher_killed_ends_every_node(net_hosts, long_reference: str, tmp_path: Path, node: int) -> None:  # noqa: F811
    hosts = net_hosts(2)
    # No replacement is started: after --node_wait_timeout the job ends (dying gasp, node named).
    runs = start_job(hosts, tmp_path, steps=dj.LONG_STEPS, extra=("--node_wait_timeout", "3"))
    try:
        dj.wait_for(lambda: dj.training(runs[0].log_dir), timeout=180)
        os.kill(runs[node].proc.pid, signal.SIGKILL)
        other = runs[1 - node]
        code = other.proc.wait(timeout=90)  # bounded: the other node never waits forever
        runs[node].proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while (all_pids(runs)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = all_pids(runs)
    finally:
        kill_left(runs)
    assert left == [], f"processes left behind: {[psutil.Process(p).cmdline() for p in left if psutil.pid_exists(p)]}"
    assert code != 0
    out = other.output()
    if node == 1:
        assert "node 1" in out, out[-3000:]
        events = dj.events(runs[0].log_dir)
        finished = [e for e in events if e["kind"] == "job_finished"][-1]
        assert "node 1" in finished["message"]
        saved = [e for e in events if e["kind"] == "checkpoint_saved"]
        assert saved, "no dying-gasp checkpoint although node 0's ranks hold every shard"
        # The same commands on both nodes resume from that checkpoint and end as without the fault.
        again = start_job(hosts, tmp_path, steps=dj.LONG_STEPS)  # same checkpoint dir; outputs rewritten
        try:
            codes = wait_all(again)
        finally:
            kill_left(again)
        assert codes == [0, 0], again[0].output()[-3000:]
        assert "starting from checkpoint" in again[0].output()
        assert dj.digest(again[0].output(), dj.LONG_STEPS) == long_reference
    else:
        assert "coordinator" in out or "stopped" in out, out[-3000:]


def _replace_node1(hosts: list[NetHost], tmp_path: Path, long_reference: str, partition: bool) -> None:
    """Hosts 0 and 1 run the job; node 1 dies (every process SIGKILLed) or is cut off (its link
    down); a replacement launcher with --node_rank 1 starts on host 2; the job ends on nodes 0 and
    the replacement with the fault-free digest, ranks 0 and 1 keep their PIDs."""
    runs = start_job(hosts[:2], tmp_path, steps=dj.LONG_STEPS, extra=("--node_wait_timeout", "120"))
    replacement = None
    try:
        dj.wait_for(lambda: dj.training(runs[0].log_dir), timeout=180)
        if partition:
            subprocess.run(["ip", "link", "set", hosts[1].veth, "down"], check=True)
        else:
            kill_host(hosts[1])
        dj.wait_for(lambda: any(e["kind"] == "node_lost" for e in dj.events(runs[0].log_dir)), timeout=60)
        replacement = start_node(hosts[2], 1, hosts[0].addr, 2, tmp_path, steps=dj.LONG_STEPS, tag="2",
                                 extra=("--node_wait_timeout", "120"))
        if partition:
            dj.wait_for(lambda: any(e["kind"] == "node_joined" and e["detail"].get("replacement")
                                    for e in dj.events(runs[0].log_dir)), timeout=120)
            subprocess.run(["ip", "link", "set", hosts[1].veth, "up"], check=True)
        codes = wait_all([runs[0], replacement])
        old_code = runs[1].proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while hosts[1].pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = hosts[1].pids()
    finally:
        kill_left([*runs, replacement])
    everything = "\n---\n".join(r.output()[-3000:] for r in [runs[0], replacement, runs[1]])
    assert codes == [0, 0], everything
    assert old_code != 0 and left == [], f"the old node 1 was not stopped: {left}\n{everything}"
    assert dj.digest(runs[0].output(), dj.LONG_STEPS) == long_reference
    events = dj.events(runs[0].log_dir)
    pids = dj.started(events)
    assert len(pids[0]) == 1 and len(pids[1]) == 1, "a rank of the surviving node was restarted"
    assert len(pids[2]) == 2 and len(pids[3]) == 2
    assert not [e for e in events if e["kind"] == "job_restarting"]
    joined = [e for e in events if e["kind"] == "node_joined" and e["detail"].get("replacement")]
    assert joined and hosts[2].addr not in ("",)
    lost = [e for e in events if e["kind"] == "node_lost"][0]
    # A killed host's connections close: its loss is seen at once, as a closed
    # connection or, when the kills reach the launcher first, as its agent saying it leaves; a cut
    # link closes nothing, and the agent's silence (the heartbeat timeout) tells.
    causes = ("silent",) if partition else ("connection_closed", "left")
    assert lost["detail"]["cause"] in causes, dj.story(events)
    # Node 1 was the coordinator's standby; the launcher that replaced it stands by in its turn.
    assert (runs[0].log_dir / "supervisor.log").read_text().count("node 1 stands by as the job coordinator") == 2


def test_lost_node_is_replaced_by_a_new_launcher(net_hosts, long_reference: str, tmp_path: Path) -> None:  # noqa: F811
    _replace_node1(net_hosts(3), tmp_path, long_reference, partition=False)


def test_a_replaced_nodes_rank_takes_its_own_state_from_the_buddy_nodes_copy(net_hosts, mnist_reference: str,  # noqa: F811
                                                                               tmp_path: Path) -> None:
    """pytorch/examples' mnist (its DataLoader's place and its dropout RNG: state only rank 1
    holds) on two hosts, a rank each. Host 1 dies whole, its record store with it; a replacement
    launcher takes node 1 on host 2, whose record store is empty: rank 1's successor reads its
    predecessor's record from the copy at node 0's record store, and the run ends bitwise equal
    to the torchrun twin's, without a divergence."""
    hosts = net_hosts(3)
    wait = ("--node_wait_timeout", "120")
    runs = [start_node(hosts[i], i, hosts[0].addr, 2, tmp_path, EXAMPLES / "mnist.py", steps=None, local=1,
                       extra=wait, script_args=tuple(MNIST_ARGS), tag=str(i)) for i in range(2)]
    replacement = None
    try:
        log = runs[0].log_dir / "worker_0.log"
        dj.wait_for(lambda: log.exists() and "Train Epoch: 2 [" in log.read_text(), timeout=180)
        kill_host(hosts[1])
        dj.wait_for(lambda: any(e["kind"] == "node_lost" for e in dj.events(runs[0].log_dir)), timeout=60)
        replacement = start_node(hosts[2], 1, hosts[0].addr, 2, tmp_path, EXAMPLES / "mnist.py", steps=None, local=1,
                                 extra=wait, script_args=tuple(MNIST_ARGS), tag="2")
        codes = wait_all([runs[0], replacement])
    finally:
        kill_left([*runs, replacement])
    everything = "\n---\n".join(r.output()[-3000:] for r in [runs[0], replacement])
    assert codes == [0, 0], everything
    assert final_digest(runs[0].output()) == mnist_reference
    events = dj.events(runs[0].log_dir)
    assert not [e["message"] for e in events if e["kind"] == "divergence"]
    pids = dj.started(events)
    assert len(pids[0]) == 1 and len(pids[1]) == 2, dj.story(events)
    successor = (replacement.log_dir / "worker_1.log").read_text()
    assert "comes from the copy at its buddy node" in successor, successor[-3000:]


def test_partitioned_node_is_replaced_and_fenced(net_hosts, long_reference: str, tmp_path: Path) -> None:  # noqa: F811
    _replace_node1(net_hosts(3), tmp_path, long_reference, partition=True)


def test_hangs_inside_recoveries_across_hosts(net_hosts, reference: str, tmp_path: Path) -> None:  # noqa: F811
    """Across two hosts: the last rank (host 1) hangs before the initial broadcast,
    then rank 0 (host 0), a donor, hangs mid-transfer to a respawned rank 2 (host 1); each is named
    by its waiting peers within seconds, replaced, and the job ends with the fault-free parameters.
    (Rank 0 hung before the broadcast is a whole-job restart, rightly: nobody else holds the
    initial state yet.)"""
    hosts = net_hosts(2)
    digest, events, runs = run_job(hosts, tmp_path, extra=RELAY, fault=(
        "rank=3,point=init,kind=hang; rank=2,step=8,kind=kill; rank=0,point=transfer,kind=hang,step=7"))
    assert digest == reference
    found = [(e["rank"], e["detail"]["fault"]) for e in events if e["kind"] == "rank_hung"]
    assert found == [(3, "stalled"), (0, "stalled")], dj.story(events)
    assert not [e for e in events if e["kind"] == "job_restarting"], dj.story(events)
    assert_relayed(runs[1])


# Node 1's ranks beat through its agent (ftrun.node.relay) in the two tests above: their liveness
# and the stall evidence (rank 3's, in its set-up on node 1) reach the coordinator only that way.
RELAY = ("--heartbeat_relay", "on")


def assert_relayed(run: NodeRun, rounds: bool = True) -> None:
    """Node ``run``'s agent relayed its ranks' heartbeats, and with ``rounds`` a round's orders
    (its log says so)."""
    log = (run.log_dir / "agent_1.log").read_text()
    assert "this node's ranks beat through this agent" in log, log[-2000:]
    if rounds:
        assert "relayed abort" in log and "relayed reconfigure" in log, log[-2000:]


def _lose_host0(hosts: list[NetHost], tmp_path: Path, fault: Any) -> tuple[list[NodeRun], NodeRun, list[int], list[int], Any]:
    """Hosts 0 and 1 run the job; host 2, started last with no index once both nodes have theirs
    (an index-less launcher could otherwise take index 1 first), waits as a standby node. Once the
    job trains, ``fault(runs)`` loses host 0; then the job must end on hosts 1 and 2 and host 0
    empty. Returns (runs, the standby's run, hosts 1 and 2's exit codes, what is left on host 0,
    what ``fault`` returned)."""
    runs = start_job(hosts[:2], tmp_path, steps=dj.LONG_STEPS, extra=("--node_wait_timeout", "120"))
    spare = None
    try:
        dj.wait_for(lambda: any(e["kind"] == "node_joined" for e in dj.events(runs[0].log_dir)), timeout=120)
        spare = start_node(hosts[2], None, hosts[0].addr, 2, tmp_path, steps=dj.LONG_STEPS, tag="2",
                           extra=("--node_wait_timeout", "120", "--cluster_time_out", "200"))
        dj.wait_for(lambda: dj.training(runs[0].log_dir), timeout=180)
        dj.wait_for(lambda: any(e["kind"] == "standby_node_joined" for e in dj.events(runs[0].log_dir)), timeout=120)
        time.sleep(1.0)  # a beat: the standby has the state of a training job and the electorate
        result = fault(runs)
        codes = wait_all([runs[1], spare])
        deadline = time.monotonic() + 30
        while hosts[0].pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = hosts[0].pids()
    finally:
        kill_left([*runs, spare])
    return runs, spare, codes, left, result


def test_node0_partitioned_the_majority_takes_over_and_node0_is_fenced(net_hosts, long_reference: str,  # noqa: F811
                                                                       tmp_path: Path) -> None:
    """Host 0's cable is pulled mid-run (its bridge port down: no reset, only silence),
    and plugged back once the job moved on. Nodes 1 and the standby node (host 2) hear nothing
    from the coordinator; host 2's agent moves to node 1's standby (a vote), which then has a
    majority of the 3 agents and takes over; node 0's coordinator, hearing 1 of 3, steps down and
    stops its ranks (exit 1). Node 0's ranks come back in the standby node's hot spares, from
    replicas on node 1. With the cable back, nothing of node 0 joins again; the job ends with the
    fault-free digest, node 1's ranks keep their processes, nothing is left on host 0."""
    hosts = net_hosts(3)

    def cut_host0(runs: list[NodeRun]) -> list[int]:
        hosts[0].set_link(False)
        code0 = wait_all([runs[0]], timeout=120)
        dj.wait_for(lambda: any(e["kind"] == "coordinator_takeover" for e in dj.events(runs[1].log_dir)), timeout=60)
        hosts[0].set_link(True)
        return code0

    runs, spare, codes, left, code0 = _lose_host0(hosts, tmp_path, cut_host0)
    everything = "\n---\n".join(r.output()[-3000:] for r in [runs[1], spare, runs[0]])
    assert code0 == [1] and "stepped down as the job coordinator" in runs[0].output(), everything
    assert codes == [0, 0], everything
    assert left == [], f"processes left on host 0: {left}"
    before, after = dj.events(runs[0].log_dir), dj.events(runs[1].log_dir)
    assert [e for e in before if e["kind"] == "coordinator_stepped_down"], dj.story(before)
    takeover = [e for e in after if e["kind"] == "coordinator_takeover"]
    assert takeover and takeover[0]["detail"]["epoch"] == 1 and "agree" in takeover[0]["detail"]["cause"], dj.story(after)
    assert dj.digest(spare.output(), dj.LONG_STEPS) == long_reference, everything
    pids = dj.started(before + after)
    assert len(pids[2]) == 1 and len(pids[3]) == 1, f"a rank of node 1 was restarted: {pids}\n{dj.story(after)}"
    old0 = {pid for rank in (0, 1) for pid in pids[rank][:1]}
    joined = [e for e in after if e["kind"] == "rank_joined" and any(f"(pid {pid})" in e["message"] for pid in old0)]
    assert not joined, f"node 0's old ranks joined the new coordinator: {joined}"
    assert not [e for e in after if e["kind"] == "job_restarting"], dj.story(after)


def _node_of(run: NodeRun) -> int | None:
    """The index a launcher started without one took (its agent's log is named after it), or None yet."""
    if (run.log_dir / "supervisor.log").exists():
        return 0
    found = [int(m.group(1)) for p in run.log_dir.glob("agent_*.log") if (m := re.fullmatch(r"agent_(\d+)\.log", p.name))]
    return found[0] if found else None


@pytest.mark.parametrize("when", ["together", "after_takeover"])
def test_node1_lost_while_it_takes_over_the_second_standby_goes_on(net_hosts, long_reference: str,  # noqa: F811
                                                                     tmp_path: Path, when: str) -> None:
    """Nodes 0 and 1 lost together (node 1 dies while it takes over from node 0).
    Four nodes of one rank each, every host started with the same command and no index; two more
    hosts, started once the job trains, wait as standby nodes with hot spares. Two nodes' agents
    stand in line as standby coordinators (node 1's from the start, another asked: the line's order
    is the order they offered). Every process of host 0 is SIGKILLed, then every process of the
    first standby's host, at once (``together``) or once it took over (``after_takeover``): the
    second standby finds the coordinator's and the first standby's processes dead (connections
    closed or refused), takes the job over, and the standby nodes take the two lost nodes, their
    hot spares the lost ranks, from replicas on the two other nodes. The job ends with the
    fault-free digest; the surviving ranks keep their processes; nothing is left behind."""
    hosts = net_hosts(6)
    slow = tmp_path / "slow"  # steps pause while it exists: the job outlasts the standbys' set-up
    slow.write_text("")
    args = ("--log_every", "10", "--step_pause", "0.6", "--pause_while", str(slow))
    extra = ("--node_wait_timeout", "120", "--cluster_time_out", "200")
    runs = [start_node(host, None, hosts[0].addr, 4, tmp_path, steps=dj.LONG_STEPS, local=1, script_args=args,
                       extra=extra, tag=str(i)) for i, host in enumerate(hosts[:4])]
    standbys: list[NodeRun] = []
    try:
        # Once every node has its index, a launcher without one waits as a standby node.
        dj.wait_for(lambda: len([e for e in dj.events(runs[0].log_dir) if e["kind"] == "node_joined"]) == 3,
                    timeout=120)  # host 0's launcher serves the store: node 0
        standbys = [start_node(host, None, hosts[0].addr, 4, tmp_path, steps=dj.LONG_STEPS, local=1, script_args=args,
                               extra=extra, tag=str(i)) for i, host in enumerate(hosts[4:], start=4)]
        ready = re.compile(r"ftrun: hot spare \(pid \d+\) waits for a rank at the training loop")
        dj.wait_for(lambda: all((r.log_dir / "spares.log").exists()
                                and ready.search((r.log_dir / "spares.log").read_text()) for r in standbys), timeout=180)
        dj.wait_for(lambda: dj.training(runs[0].log_dir), timeout=180)
        # The launchers took their indexes in the order they reached node 0's store: find which is which.
        dj.wait_for(lambda: all(_node_of(r) is not None for r in runs), timeout=60)
        runs.sort(key=_node_of)
        status = runs[0].log_dir / "status.json"
        line: list[int] = []

        def two_in_line() -> bool:
            nonlocal line
            try:
                line = json.loads(status.read_text()).get("standby_coordinators", [])
            except (OSError, ValueError):
                return False
            return len(line) == 2

        dj.wait_for(two_in_line, timeout=60)  # node 1's from the start; another asked (the order of joining)
        first, second = line
        time.sleep(1.0)  # a beat: both standbys have the state of a training job
        for run in (runs[0], runs[first]):
            if run is runs[first] and when == "after_takeover":
                # Taken over: node 0 declared lost too (the takeover publishes its endpoint in the
                # store between the two events: a kill in between would leave no node_lost event
                # to check below).
                dj.wait_for(lambda: {"coordinator_takeover", "node_lost"} <= {e["kind"] for e in dj.events(runs[first].log_dir)},
                            timeout=60)
            for pid in run.host.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        dj.wait_for(lambda: any(e["kind"] == "recovery_finished" for e in dj.events(runs[second].log_dir)), timeout=120)
        # The new coordinator has a standby in line again (another node's agent asked; a standby
        # node that took a lost node's index is one).
        new_status = runs[second].log_dir / "status.json"
        dj.wait_for(lambda: new_status.exists() and json.loads(new_status.read_text()).get("standby_coordinators"),
                    timeout=60)
        slow.unlink()
        survivors = [r for i, r in enumerate(runs) if i not in (0, first)]
        codes = wait_all([*survivors, *standbys])
        deadline = time.monotonic() + 30
        while any(h.pids() for h in hosts) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {i: h.pids() for i, h in enumerate(hosts) if h.pids()}
    finally:
        kill_left([*runs, *standbys])
    everything = "\n---\n".join(r.output()[-3000:] for r in [*survivors, *standbys])
    assert codes == [0, 0, 0, 0], everything
    assert left == {}, f"processes left behind: {left}\n{everything}"
    digests = [dj.FINAL.search(r.output()) for r in standbys]
    assert [m.group(3) for m in digests if m] == [long_reference], everything  # rank 0 runs on a standby node now
    before = dj.events(runs[0].log_dir) + dj.events(runs[first].log_dir)
    after = dj.events(runs[second].log_dir)
    takeover = [e for e in after if e["kind"] == "coordinator_takeover"]
    assert takeover and takeover[0]["detail"]["node"] == second, dj.story(after)
    lost = sorted([takeover[0]["detail"]["lost"], *takeover[0]["detail"]["lost_standbys"]])
    assert lost == sorted([0, first]) or (when == "after_takeover" and lost == [first]), dj.story(after)
    assert {e["detail"]["node_lost"] for e in before + after if e["kind"] == "node_lost"} == {0, first}, dj.story(after)
    pids = dj.started(before + after)
    kept = [n for n in range(4) if n not in (0, first)]
    assert all(len(pids[n]) == 1 for n in kept), f"a rank of nodes {kept} was restarted: {pids}\n{dj.story(after)}"
    assert not [e for e in before + after if e["kind"] == "job_restarting"], dj.story(after)
    respawned = [e for e in after if e["kind"] == "rank_started" and e["rank"] in (0, first)]
    assert respawned and all(e["detail"]["hot_spare"] for e in respawned), dj.story(after)
    if when == "after_takeover":
        # The first takeover, as when only node 0 is lost: at once (node 0's kernel closed its
        # connections), epoch 1, node 0 lost with its coordinator (its rank is respawned in a
        # standby node's hot spare, though the first standby may die before it says so).
        middle = dj.events(runs[first].log_dir)
        took = [e for e in middle if e["kind"] == "coordinator_takeover"]
        # The second's epoch is 2, or 1 when its state is the first coordinator's (the first
        # standby died before it replicated: both epochs are 1, and one of them is dead).
        assert took and took[0]["detail"]["epoch"] == 1 and takeover[0]["detail"]["epoch"] in (1, 2), dj.story(middle)
        lost0 = [e for e in middle if e["kind"] == "node_lost"]
        assert lost0 and lost0[0]["detail"]["node_lost"] == 0 and lost0[0]["detail"]["cause"] == "coordinator_lost"


def _flap(host: NetHost, seconds: float) -> None:
    """Pull ``host``'s cable for ``seconds``, then plug it back (silence only: nothing is reset)."""
    host.set_link(False)
    try:
        time.sleep(seconds)
    finally:
        host.set_link(True)


def test_link_flaps_are_weather_not_loss(net_hosts, long_reference: str, tmp_path: Path) -> None:  # noqa: F811
    """Node 1's cable is pulled for 8 s, later for 20 s, then node 0's for 8 s, in one job. Each
    flap outlasts the heartbeat timeout, so the coordinator declares node 1 lost (with two nodes
    neither side can tell whose link failed: node 0's flap looks like node 1's, and the loss says
    so); node 1's agent keeps trying instead of leaving, is fenced when its link returns, and
    rejoins as its own replacement: one recovery and one restart per flap, node 0's ranks keep
    their PIDs, and the job ends with the fault-free parameters."""
    hosts = net_hosts(2)
    pause = tmp_path / "pause"
    pause.touch()  # steps sleep 0.2 s while the flaps are made; removed, the job runs to its end
    runs = start_job(hosts, tmp_path, steps=dj.LONG_STEPS, extra=("--node_wait_timeout", "120"),
                     script_args=("--log_every", "10", "--step_pause", "0.2", "--pause_while", str(pause)))

    def recoveries() -> int:
        return sum(e["kind"] == "recovery_finished" for e in dj.events(runs[0].log_dir))

    try:
        dj.wait_for(lambda: dj.training(runs[0].log_dir), timeout=180)
        for n, (host, seconds) in enumerate(((hosts[1], 8.0), (hosts[1], 20.0), (hosts[0], 8.0)), start=1):
            _flap(host, seconds)
            dj.wait_for(lambda: recoveries() >= n, timeout=120)
            time.sleep(2.0)  # a few steps between flaps
        pause.unlink()
        codes = wait_all(runs)
    finally:
        kill_left(runs)
    events = dj.events(runs[0].log_dir)
    everything = dj.story(events) + "\n---\n" + "\n---\n".join(r.output()[-3000:] for r in runs)
    assert codes == [0, 0], everything
    assert dj.digest(runs[0].output(), dj.LONG_STEPS) == long_reference
    pids = dj.started(events)
    assert len(pids[0]) == 1 and len(pids[1]) == 1, "a rank of node 0 was restarted\n" + everything
    assert len(pids[2]) == 4 and len(pids[3]) == 4, everything  # node 1's ranks: respawned once per flap
    lost = [e for e in events if e["kind"] == "node_lost"]
    assert [e["detail"]["node_lost"] for e in lost] == [1, 1, 1] and all(e["detail"]["cause"] == "silent" for e in lost)
    assert all("no other node's agent is heard either" in e["message"] for e in lost), everything
    assert recoveries() == 3 and not [e for e in events if e["kind"] in ("job_restarting", "rank_hung")], everything
    assert [e for e in events if e["kind"] == "job_finished"][-1]["detail"]["restarts"] == 3  # one per flap
    assert "hears nothing from the job coordinator" in runs[1].output(), runs[1].output()[-3000:]
    assert "rejoining as its replacement" in runs[1].output(), runs[1].output()[-3000:]


def test_an_elastic_job_goes_on_without_a_lost_node_and_takes_it_back(net_hosts, tmp_path: Path) -> None:  # noqa: F811
    """--nnodes 2:3 on three hosts, 2 ranks each. Host 2 is killed and no node takes its place:
    within --replace_timeout its ranks 4 and 5 start on hosts 0 and 1 and recover from replicas,
    the job goes on there with the same 6 ranks (the same samples each step), and ranks 0-3 keep
    their processes. A fourth host's launcher then takes index 2: ranks 4 and 5 move back to it,
    for no restart. The parameters equal those of a fault-free 6-rank run, bit for bit."""
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    ref = subprocess.run([*[("6" if w == "4" else w) for w in dj.cmd(reference_dir / "logs", dj.LONG_STEPS)]],
                         env=dj.env(), capture_output=True, text=True, timeout=400, cwd=reference_dir)
    assert ref.returncode == 0, ref.stdout[-3000:]
    reference = dj.digest(ref.stdout, dj.LONG_STEPS)
    hosts = net_hosts(4)
    pause = tmp_path / "pause"
    pause.touch()
    elastic = ("--nnodes", "2:3", "--replace_timeout", "3", "--node_wait_timeout", "120")
    args = ("--log_every", "10", "--step_pause", "0.2", "--pause_while", str(pause))
    runs = start_job(hosts[:3], tmp_path, steps=dj.LONG_STEPS, extra=elastic, script_args=args)
    late = None
    try:
        dj.wait_for(lambda: len({e["rank"] for e in dj.events(runs[0].log_dir) if e["kind"] == "rank_joined"}) == 6
                    and "step 20 loss" in (runs[0].log_dir / "worker_0.log").read_text(), timeout=240)
        for pid in hosts[2].pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        dj.wait_for(lambda: any(e["kind"] == "job_shrunk" for e in dj.events(runs[0].log_dir)), timeout=60)
        dj.wait_for(lambda: sum(e["kind"] == "recovery_finished" for e in dj.events(runs[0].log_dir)) >= 1, timeout=120)
        late = start_node(hosts[3], 2, hosts[0].addr, 3, tmp_path, steps=dj.LONG_STEPS, tag="3", extra=elastic,
                          script_args=args)
        dj.wait_for(lambda: sum(e["kind"] == "recovery_finished" for e in dj.events(runs[0].log_dir)) >= 2, timeout=120)
        pause.unlink()
        codes = wait_all([runs[0], runs[1], late])
    finally:
        kill_left([*runs, late])
    events = dj.events(runs[0].log_dir)
    everything = dj.story(events) + "\n---\n" + "\n---\n".join(r.output()[-2500:] for r in [runs[0], runs[1], late])
    assert codes == [0, 0, 0], everything
    assert dj.digest(runs[0].output(), dj.LONG_STEPS) == reference, everything
    lost = [e for e in events if e["kind"] == "node_lost"][0]
    shrunk = [e for e in events if e["kind"] == "job_shrunk"][0]
    assert shrunk["detail"]["ranks"] == [4, 5] and sorted(shrunk["detail"]["placed"].values()) == [0, 1], everything
    assert shrunk["time"] - lost["time"] < 5.0, everything  # --replace_timeout (3 s) after the verdict
    grown = [e for e in events if e["kind"] == "job_grown"]
    assert grown and grown[0]["detail"]["ranks"] == [4, 5], everything
    pids = dj.started(events)
    assert all(len(pids[r]) == 1 for r in range(4)), "a surviving rank was restarted\n" + everything
    assert len(pids[4]) == 3 and len(pids[5]) == 3, everything  # host 2, moved, back on host 3
    assert [e for e in events if e["kind"] == "job_finished"][-1]["detail"]["restarts"] == 1, everything
    assert not [e for e in events if e["kind"] == "job_restarting"], everything
