"""A real Slurm cluster on test hosts (network namespaces, :mod:`nethosts`): one controller, N nodes.

Host 0 runs ``munged`` and ``slurmctld``; host ``i`` (1..N) runs one ``slurmd`` named ``sn<i>``
(``NodeName=sn<i> NodeAddr=<its address> Port=<its own port>``), each with its own spool
directory, pid and log files under one temporary directory. Debian's ``slurm-wlm`` (22.05) and
``munge`` packages provide the daemons; the settings are the ones that work in a container without
systemd or a writable cgroup hierarchy: ``ProctrackType=proctrack/linuxproc`` (a step's processes
are the descendants of its slurmstepd), ``TaskPlugin=task/none``, no accounting, and
``SlurmdParameters=config_overrides`` (every node claims :data:`NODE_CPUS` CPUs whatever the machine
has). ``ReturnToService=2`` and a short ``SlurmdTimeout`` let a test lose a node and see it DOWN
within seconds; a short ``cred_expire`` (:data:`CRED_EXPIRE`) lets a requeued job start again after
10 s instead of Slurm's 120.

Node names must resolve on every host (Slurm hands them to ftrun as ``SLURM_JOB_NODELIST``): each
namespace gets ``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` binds over ``/etc/hosts``
for the processes it starts (slurmd's jobs inherit it). :meth:`SlurmCluster.close` kills every
process in the hosts (the network's own close), and removes those files and the temporary directory;
what a killed session left behind is removed by the next one (:func:`cleanup_stale`).

Commands (``sbatch``, ``squeue``, ``scontrol``...) run in host 0 with :meth:`SlurmCluster.cmd`;
``SLURM_CONF`` names the cluster's slurm.conf.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Callable, Mapping, Sequence

from nethosts import HostNetwork, NetHost

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "sinfo", "scontrol", "scancel", "srun")
NODE_CPUS = 8  # what each node claims (the batch script asks for --cpus-per-task=8)
CTLD_PORT = 16817
SLURMD_PORT0 = 17001  # node i listens on SLURMD_PORT0 + i - 1
SLURMD_TIMEOUT = 5  # seconds without an answer before slurmctld sets a node DOWN
KILL_WAIT = 30  # seconds between a job's SIGTERM and its SIGKILL (Slurm's default is 30)
CRED_EXPIRE = 10  # AuthInfo cred_expire: also how long a requeued job waits before it may start (default 120 s)
ETC_NETNS = Path("/etc/netns")


def unavailable_reason(install: bool = True) -> str | None:
    """Why a Slurm cluster cannot be brought up here (one line), or None.

    Installs ``slurm-wlm`` and ``munge`` with apt when they are missing and ``install`` is set, as
    root where ``apt-get`` exists (scripts/setup_tests.sh does the same).
    """
    import nethosts

    reason = nethosts.unavailable_reason()
    if reason is not None:
        return reason
    missing = [d for d in DAEMONS if _which(d) is None]
    if missing and install and shutil.which("apt-get") and os.geteuid() == 0:
        proc = subprocess.run(["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"], capture_output=True, text=True,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, timeout=600)
        if proc.returncode != 0:
            last = (proc.stderr.strip() or proc.stdout.strip() or "?").splitlines()[-1]
            return f"apt-get install slurm-wlm munge failed: {last}"
        missing = [d for d in DAEMONS if _which(d) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing; apt-get install slurm-wlm munge, as root)"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Remove what a killed test session left outside its network (nethosts removes the namespaces
    and their processes): ``/etc/netns/<namespace>`` and ``$TMPDIR/ftslurm-<pid>-*`` of dead pids.

    Returns:
        The paths removed.
    """
    import nethosts

    removed = []
    for d in ETC_NETNS.glob(f"{nethosts.PREFIX}*"):
        pid = nethosts.creator_pid(d.name)
        if pid is not None and not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    for d in Path(tempfile.gettempdir()).glob("ftslurm-*-*"):
        pid = d.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


class SlurmCluster:
    """slurmctld and munged on ``hosts[0]``, one slurmd on each other host; see the module docstring.

    Attributes:
        hosts: The network's hosts (``hosts[0]`` the controller).
        nodes: Node name -> its host (``sn1`` on ``hosts[1]``...).
        root: The temporary directory of every file the cluster writes.
        conf: Path of slurm.conf.
    """

    def __init__(self, n_nodes: int = 3, kill_wait: int = KILL_WAIT) -> None:
        cleanup_stale()
        self.network = HostNetwork(n_nodes + 1)
        self.hosts = self.network.hosts
        self.nodes = {f"sn{i}": host for i, host in enumerate(self.hosts) if i > 0}
        self.root = Path(tempfile.mkdtemp(prefix=f"ftslurm-{os.getpid()}-"))
        self.conf = self.root / "slurm.conf"
        self._etc: list[Path] = []
        self._made_etc_netns = not ETC_NETNS.exists()
        self._slurmd: dict[str, subprocess.Popen] = {}
        try:
            self._write_files(kill_wait)
            self._start()
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------- set-up
    def _write_files(self, kill_wait: int) -> None:
        r = self.root
        (r / "ctld").mkdir()
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (r / "munge").mkdir(mode=0o755)
        ctl = self.hosts[0]
        lines = [
            "ClusterName=ftrun",
            f"SlurmctldHost={socket.gethostname()}({ctl.addr})",  # every host has the machine's hostname
            "MailProg=/bin/true",
            f"SlurmctldPort={CTLD_PORT}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge' / 'munge.socket'},cred_expire={CRED_EXPIRE}",
            f"StateSaveLocation={r / 'ctld'}",
            f"SlurmdSpoolDir={r}/spool-%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            # A requeued job becomes eligible with no event to wake the scheduler: it starts at the
            # next pass, up to 30 s (backfill) or 60 s (main loop) later with Slurm's defaults.
            "SchedulerParameters=bf_interval=2,sched_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            f"SlurmdTimeout={SLURMD_TIMEOUT}",
            "SlurmctldTimeout=10",
            "MessageTimeout=5",
            f"KillWait={kill_wait}",
            "InactiveLimit=0",
            "MinJobAge=300",
            "OverTimeLimit=0",
        ]
        for i, (name, host) in enumerate(self.nodes.items()):
            lines.append(f"NodeName={name} NodeAddr={host.addr} Port={SLURMD_PORT0 + i} CPUs={NODE_CPUS} State=UNKNOWN")
        lines.append(f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        # slurmd 22.05 initialises a cgroup plugin even with proctrack/linuxproc and task/none; its
        # "autodetect" fails on a tmpfs /sys/fs/cgroup (v1 controllers mounted below it, as here).
        (r / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")
        for name in self.nodes:
            (r / f"spool-{name}").mkdir()
        hosts_text = Path("/etc/hosts").read_text() + "\n" + "".join(f"{h.addr} {n}\n" for n, h in self.nodes.items())
        for host in self.hosts:
            d = ETC_NETNS / host.name
            d.mkdir(parents=True, exist_ok=True)
            self._etc.append(d)
            (d / "hosts").write_text(hosts_text)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (os.environ) with SLURM_CONF set, without the caller's SLURM_* variables."""
        env = {k: v for k, v in dict(os.environ if base is None else base).items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _log(self, name: str) -> IO[bytes]:
        return open(self.root / f"{name}.stdout", "wb")

    def _start(self) -> None:
        r = self.root
        ctl = self.hosts[0]
        with self._log("munged") as out:
            ctl.popen([_which("munged"), "-F", "--force", f"--key-file={r / 'munge.key'}",
                       f"--socket={r / 'munge' / 'munge.socket'}", f"--pid-file={r / 'munge' / 'munged.pid'}",
                       f"--log-file={r / 'munged.log'}", f"--seed-file={r / 'munge' / 'munged.seed'}"],
                      env=self.env(), stdout=out, stderr=subprocess.STDOUT)
        self._wait(lambda: (r / "munge" / "munge.socket").exists(), 30, "munged did not start")
        with self._log("slurmctld") as out:
            self.ctld = ctl.popen([_which("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf)], env=self.env(),
                                  stdout=out, stderr=subprocess.STDOUT)
        self._wait(lambda: self.cmd(["scontrol", "ping"], timeout=20).stdout.count("UP") > 0, 60,
                   "slurmctld did not answer")
        for name in self.nodes:
            self.start_slurmd(name)
        self.wait_nodes("idle", list(self.nodes), timeout=60)

    def start_slurmd(self, name: str) -> None:
        """Start (or start again) node ``name``'s slurmd in its host."""
        host = self.nodes[name]
        with self._log(f"slurmd-{name}") as out:
            self._slurmd[name] = host.popen([_which("slurmd"), "-D", "-N", name, "-f", str(self.conf)], env=self.env(),
                                            stdout=out, stderr=subprocess.STDOUT)

    def _wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout:g} s\n{self.logs()}")
            time.sleep(0.2)

    # ----------------------------------------------------------------- use
    def cmd(self, argv: Sequence[str], timeout: float = 60, cwd: str | os.PathLike[str] | None = None,
            env: Mapping[str, str] | None = None, host: NetHost | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (``sbatch ...``) in ``host`` (the controller's by default)."""
        argv = [_which(argv[0]) or argv[0], *argv[1:]]
        return (host or self.hosts[0]).run(argv, timeout=timeout, env=self.env(base=env), cwd=cwd)

    def node_states(self) -> dict[str, str]:
        """Node name -> its state in lower case (``idle``, ``alloc``, ``down*``...)."""
        out = self.cmd(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_nodes(self, state: str, names: Sequence[str], timeout: float) -> None:
        """Wait until every node of ``names`` is in ``state`` (``idle``, ``down``: a trailing ``*`` ignored)."""
        self._wait(lambda: all(self.node_states().get(n, "").rstrip("*~#!%$@^-") == state for n in names), timeout,
                   f"nodes {list(names)} not {state}")

    def end_steps_on(self, name: str) -> int:
        """SIGKILL the ``srun`` clients (on any host) of steps placed on node ``name`` after
        :meth:`kill_node`: they wait for the dead node until slurmctld marks it down (its
        SlurmdTimeout, minutes), then Slurm ends them; this does it at once, as that would.
        Returns how many were ended."""
        import psutil

        ended = []
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = proc.info["cmdline"] or []
            if cmdline[:1] == ["srun"] and f"--nodelist={name}" in cmdline:
                try:
                    proc.kill()
                    ended.append(proc)
                except psutil.Error:
                    continue
        psutil.wait_procs(ended, timeout=10)
        return len(ended)

    def restore(self, timeout: float = 60) -> None:
        """Every host's link up, a slurmd on every node host without processes (one a test or a
        benchmark killed with :meth:`kill_node`), then wait until every node is idle."""
        for host in self.hosts:
            subprocess.run(["ip", "link", "set", host.veth, "up"], check=True)
        for name, host in self.nodes.items():
            if not host.pids():
                self.start_slurmd(name)
        self.wait_nodes("idle", list(self.nodes), timeout=timeout)

    def kill_node(self, name: str) -> float:
        """SIGKILL every process of node ``name`` (its slurmd, slurmstepd, launcher and ranks): a
        dead machine. Its link goes down first, so that nothing it sends while dying (a launcher's
        goodbye, the kernel's FIN of a killed process's sockets) reaches anyone: the others learn
        of the loss by silence, as from a machine that lost power; :meth:`restore` brings it up
        again.

        Returns:
            The wall-clock time of the kill (``time.time()``, seconds), taken once the link is down.

        Raises:
            RuntimeError: a process of the host survived 30 s of SIGKILLs.
        """
        host = self.nodes[name]
        subprocess.run(["ip", "link", "set", host.veth, "down"], check=True)
        at = time.time()
        deadline = time.monotonic() + 30
        while pids := host.pids():
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of {name} survive SIGKILL: {pids}")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        return at

    def job_state(self, job: str) -> str:
        """The job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``CANCELLED``...), from the controller."""
        out = self.cmd(["scontrol", "-o", "show", "job", job], timeout=30).stdout
        for tok in out.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return "UNKNOWN"

    def logs(self) -> str:
        """The end of every daemon's log, for a failure's message."""
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.stdout")):
            try:
                parts.append(f"== {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-25:]))
            except OSError:
                pass
        return "\n".join(parts)

    def close(self) -> None:
        """Kill every daemon and job process, remove the hosts, the /etc/netns files and the directory."""
        try:
            self.network.close()
        finally:
            for d in self._etc:
                shutil.rmtree(d, ignore_errors=True)
            if self._made_etc_netns:
                try:
                    ETC_NETNS.rmdir()  # only if empty: another network's files stay
                except OSError:
                    pass
            shutil.rmtree(self.root, ignore_errors=True)
