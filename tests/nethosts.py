"""Multi-node test hosts on one machine: Linux network namespaces joined by a bridge.

A :class:`HostNetwork` of ``n`` hosts builds this topology in the root network namespace::

    namespace ftn<pid>-<k>h0          namespace ftn<pid>-<k>h1         ...
    +---------------------+           +---------------------+
    | lo    127.0.0.1     |           | lo    127.0.0.1     |
    | eth0  10.213.X.1/24 |           | eth0  10.213.X.2/24 |
    +---------|-----------+           +---------|-----------+
              | veth pair                       | veth pair
    ftn<pid>-<k>v0                    ftn<pid>-<k>v1
              |                                 |
    +---------+---------------------------------+------------+
    |              bridge ftn<pid>-<k>br  (no address)       |   root namespace
    +--------------------------------------------------------+

Every host is one network namespace holding the loopback device and one end of a veth pair, named
``eth0`` there and given the host's IPv4 address in a private /24; the other end is a port of the
bridge. Neither the bridge nor the root-side veths carry an address (IPv6 link-local generation is
off on every device made here, too), there is no default route in the namespaces, no NAT and no
forwarding: the hosts reach each other and nothing else, and the root namespace cannot reach them.
A fresh namespace has all of its ports free, so fixed port numbers are fine inside it.

Names carry the creating process's pid and a per-process counter, both in base 36 (``<pid>`` and
``<k>`` above), so that root-side interface names stay within Linux's 15 characters. That pid lets
the next :class:`HostNetwork` remove what a crashed run left behind (see :func:`cleanup_stale`).

Processes are started in a host with ``ip netns exec`` (:meth:`NetHost.popen`, :meth:`NetHost.run`),
each in a session of its own. :meth:`HostNetwork.close` SIGKILLs those sessions, then whatever else
``ip netns pids`` still finds in the namespaces (daemonised grandchildren included), and deletes the
veths, the namespaces and the bridge; it is idempotent, and an ``atexit`` hook calls it for
networks still open when the interpreter exits. A SIGKILLed pytest runs no hook: the stale cleanup
of the next run takes care of that.

Measured on the development machine: the machine's hostname resolves to 127.0.0.1 (``/etc/hosts``),
inside a namespace too, and gloo derives its listening address from the hostname unless told an
interface; ranks on different hosts then advertise 127.0.0.1 to each other. Start ranks with
:meth:`NetHost.env`, which sets ``GLOO_SOCKET_IFNAME`` (and ``TP_SOCKET_IFNAME`` for tensorpipe) to
the host's interface.

This module needs no pytest: ``sys.path.insert(0, "tests"); import nethosts`` works from a script.
Under pytest, ``from nethosts import net_hosts  # noqa: F401`` in a test module makes the
:func:`net_hosts` fixture available to that module; it skips (with a one-line reason) where
namespaces cannot be made: not root, no ``ip``, or ``ip netns add`` refused (unprivileged container).
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, Callable, Iterator, Mapping, Sequence

try:
    import pytest
except ImportError:  # a benchmark script without pytest installed
    pytest = None  # type: ignore[assignment]

PREFIX = "ftn"
"""First characters of every namespace, bridge and veth this module makes."""

IFNAME_MAX = 15
"""Longest network interface name Linux accepts (IFNAMSIZ - 1)."""

SUBNET_BASE = "10.213"
"""The hosts' /24 is ``SUBNET_BASE.X.0/24`` for an X not in use in the root namespace."""

DEFAULT_IFNAME = "eth0"

KILL_TIMEOUT = 10.0
"""Seconds :meth:`HostNetwork.close` waits for the SIGKILLed processes of a namespace to go."""

_NAME_RE = re.compile(rf"^{PREFIX}([0-9a-z]+)-([0-9a-z]+)(br|h\d+|v\d+)$")
_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"

StdStream = int | IO[Any] | None


def _b36(value: int) -> str:
    """``value`` (>= 0) in base 36, lower case."""
    digits = ""
    while True:
        value, rem = divmod(value, 36)
        digits = _B36[rem] + digits
        if value == 0:
            return digits


def resource_names(pid: int, serial: int, n: int) -> tuple[str, list[str], list[str]]:
    """Names of the bridge, the namespaces and the root-side veths of one network.

    Args:
        pid: The creating process's id.
        serial: The network's number within that process.
        n: Number of hosts.

    Returns:
        ``(bridge, namespaces, veths)``; ``namespaces[i]`` and ``veths[i]`` belong to host ``i``.

    Raises:
        ValueError: If an interface name would exceed :data:`IFNAME_MAX` characters.
    """
    base = f"{PREFIX}{_b36(pid)}-{_b36(serial)}"
    bridge = f"{base}br"
    namespaces = [f"{base}h{i}" for i in range(n)]
    veths = [f"{base}v{i}" for i in range(n)]
    for name in [bridge, *veths]:
        if len(name) > IFNAME_MAX:
            raise ValueError(f"interface name {name!r} is longer than {IFNAME_MAX} characters")
    return bridge, namespaces, veths


def creator_pid(name: str) -> int | None:
    """The pid encoded in a name made by this module, or None for any other name."""
    match = _NAME_RE.match(name)
    return int(match.group(1), 36) if match else None


# --------------------------------------------------------------------------- ip(8)


def _ip_path() -> str:
    path = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin:/usr/bin:/bin")
    if path is None:
        raise FileNotFoundError("iproute2's `ip` command is not installed")
    return path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; with ``check``, raise a RuntimeError carrying ip's message on failure."""
    proc = subprocess.run([_ip_path(), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if check and proc.returncode != 0:
        message = (proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}").splitlines()[0]
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {message}")
    return proc


def list_namespaces() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_links() -> list[str]:
    """Names of the root namespace's network interfaces (without any ``@peer`` suffix)."""
    out = _ip("-o", "link", "show", check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def namespace_pids(namespace: str) -> list[int]:
    """Pids of the live (non-zombie) processes in ``namespace`` (``ip netns pids``)."""
    out = _ip("netns", "pids", namespace, check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str, timeout: float = KILL_TIMEOUT) -> list[int]:
    """SIGKILL every process in ``namespace`` until none is left; return the survivors after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [pid for pid in namespace_pids(namespace) if pid != os.getpid()]
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)


def _used_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of the root namespace's addresses and routes."""
    nets: list[ipaddress.IPv4Network] = []
    for line in _ip("-o", "-4", "addr", "show", check=False).stdout.splitlines():
        match = re.search(r"\binet (\S+)", line)
        if match:
            nets.append(ipaddress.IPv4Interface(match.group(1)).network)
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        tokens = line.split()
        if tokens and tokens[0] in ("local", "broadcast", "unicast", "throw", "blackhole", "unreachable"):
            tokens = tokens[1:]
        if not tokens or tokens[0] == "default":
            continue
        try:
            nets.append(ipaddress.IPv4Network(tokens[0], strict=False))
        except ValueError:
            continue
    return nets


# --------------------------------------------------------------------------- stale cleanup


def cleanup_stale() -> list[str]:
    """Delete what this module made for processes that are no longer alive.

    Finds namespaces and root-namespace interfaces named by :func:`resource_names` whose creating
    pid is dead, SIGKILLs the processes left in those namespaces and deletes the namespaces, veths
    and bridges. Networks of live processes (other test sessions included) are left alone. A
    crashed creator whose pid was since reused by a live process is not detected.

    Returns:
        The names deleted.
    """
    removed: list[str] = []
    for namespace in list_namespaces():
        pid = creator_pid(namespace)
        if pid is None or _pid_alive(pid):
            continue
        _kill_namespace_processes(namespace)
        if _ip("netns", "del", namespace, check=False).returncode == 0:
            removed.append(namespace)
    links = [name for name in list_links() if (pid := creator_pid(name)) is not None and not _pid_alive(pid)]
    # veths first: deleting one end removes its peer in the namespace; then the emptied bridges.
    for name in sorted(links, key=lambda name: name.endswith("br")):
        if _ip("link", "del", name, check=False).returncode == 0:
            removed.append(name)
    return removed


# --------------------------------------------------------------------------- hosts


class NetHost:
    """One test host: a network namespace with one interface on the shared bridge.

    Attributes:
        network: The :class:`HostNetwork` this host belongs to.
        index: Position of the host in ``network.hosts`` (0-based).
        name: Name of the network namespace (for ``ip netns exec NAME``).
        addr: The host's IPv4 address, dotted quad.
        ifname: Name of the host's interface inside its namespace (``eth0``).
        veth: Name of the root-namespace end of the host's veth pair (a bridge port).
    """

    def __init__(self, network: HostNetwork, index: int, name: str, addr: str, ifname: str, veth: str) -> None:
        self.network = network
        self.index = index
        self.name = name
        self.addr = addr
        self.ifname = ifname
        self.veth = veth
        self._procs: list[subprocess.Popen[Any]] = []

    def __repr__(self) -> str:
        return f"NetHost(index={self.index}, name={self.name!r}, addr={self.addr!r}, ifname={self.ifname!r})"

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs in this host: ``ip netns exec NAME ARGV...``.

        Processes started from such an argv by other means are not tracked by :meth:`popen`, but
        :meth:`HostNetwork.close` still kills them through ``ip netns pids``.
        """
        return [_ip_path(), "netns", "exec", self.name, *[str(a) for a in argv]]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a launcher or rank on this host: ``base`` plus the socket interface.

        Inside a namespace the machine's hostname may resolve to 127.0.0.1 (it does on the machine
        this was written on), and gloo picks the address it advertises from the hostname unless
        ``GLOO_SOCKET_IFNAME`` names an interface; tensorpipe reads ``TP_SOCKET_IFNAME``.

        Args:
            base: The environment to start from; ``os.environ`` when None. Not modified.

        Returns:
            A new dict with ``GLOO_SOCKET_IFNAME`` and ``TP_SOCKET_IFNAME`` set to :attr:`ifname`.
        """
        env = dict(os.environ if base is None else base)
        env["GLOO_SOCKET_IFNAME"] = self.ifname
        env["TP_SOCKET_IFNAME"] = self.ifname
        return env

    def popen(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdin: StdStream = subprocess.DEVNULL,
        stdout: StdStream = None,
        stderr: StdStream = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` in this host, in a new session; :meth:`HostNetwork.close` kills it.

        ``ip netns exec`` execs the command, so the returned process's pid is the command's and its
        process group id too. The program of ``argv[0]`` is looked up in ``env``'s PATH; prefer
        absolute paths (``sys.executable``).

        Args:
            argv: The command and its arguments.
            env: The command's environment (``os.environ`` when None); see :meth:`env`.
            cwd: Its working directory.
            stdin: As for :class:`subprocess.Popen`; DEVNULL by default, not the caller's stdin.
            stdout: As for :class:`subprocess.Popen`.
            stderr: As for :class:`subprocess.Popen`.
            **kwargs: Passed on to :class:`subprocess.Popen` (``text``, ``pass_fds``...), except
                ``start_new_session``, which is always True.

        Returns:
            The started process.

        Raises:
            RuntimeError: If the network is closed.
        """
        self.network._check_open()
        kwargs["start_new_session"] = True
        proc = subprocess.Popen(
            self.exec_argv(argv),
            env=None if env is None else dict(env),
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            **kwargs,
        )
        self._procs.append(proc)
        return proc

    def run(
        self,
        argv: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        input: str | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in this host to completion, capturing its output as text.

        Args:
            argv: The command and its arguments.
            timeout: Seconds to wait before the command's session is SIGKILLed.
            env: The command's environment (``os.environ`` when None).
            cwd: Its working directory.
            input: Text for its stdin (stdin is /dev/null when None).
            check: Raise :class:`subprocess.CalledProcessError` on a non-zero exit status.

        Returns:
            The completed process, with ``stdout`` and ``stderr`` as str.

        Raises:
            subprocess.TimeoutExpired: If it ran longer than ``timeout`` (it is killed first).
        """
        proc = self.popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        with proc:
            try:
                out, err = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                _killpg(proc)
                out, err = proc.communicate()
                exc.stdout, exc.stderr = out, err
                raise
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def pids(self) -> list[int]:
        """Pids of the live processes in this host's namespace."""
        return namespace_pids(self.name)

    def set_link(self, up: bool) -> None:
        """Plug (``up``) or pull this host's cable: its bridge port goes up or down. Down, its
        packets are dropped silently, as with a cut cable or a dead switch port: no reset, so its
        peers notice only by silence. :meth:`HostNetwork.close` removes the port either way."""
        self.network._check_open()
        _ip("link", "set", self.veth, "up" if up else "down")


def _killpg(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the session of a process started by :meth:`NetHost.popen`, if not reaped yet."""
    if proc.returncode is not None:
        return  # reaped: its pid (and group id) may belong to someone else by now
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class HostNetwork:
    """``n`` test hosts (network namespaces) on one bridge, torn down by :meth:`close`.

    Use as a context manager, or call :meth:`close` (idempotent) in a ``finally``. Creating one
    first removes the leftovers of dead processes (:func:`cleanup_stale`).

    Attributes:
        hosts: The hosts, ``hosts[i].index == i``.
        bridge: Name of the bridge in the root namespace.
        subnet: The hosts' IPv4 network; host ``i`` has address ``i + 1`` in it.
    """

    _serial = itertools.count()
    _lock = threading.Lock()
    _open: set[HostNetwork] = set()
    _atexit_registered = False

    def __init__(self, n: int = 2, *, subnet: str | None = None, ifname: str = DEFAULT_IFNAME) -> None:
        """Create the namespaces, the bridge and the veths, and bring everything up.

        Args:
            n: Number of hosts, 1 to 250.
            subnet: The hosts' IPv4 network (at least ``n + 2`` addresses); by default a /24 of
                ``10.213.0.0/16`` that no address or route of the root namespace overlaps.
            ifname: Name of each host's interface inside its namespace.

        Raises:
            ValueError: On a bad ``n``, ``subnet`` or ``ifname``.
            RuntimeError: If an ``ip`` command fails (what was made is removed again).
        """
        if not 1 <= n <= 250:
            raise ValueError(f"n must be between 1 and 250, not {n}")
        if not ifname or len(ifname) > IFNAME_MAX or "/" in ifname or ifname.strip() != ifname:
            raise ValueError(f"bad interface name {ifname!r}")
        self._owner = os.getpid()
        self._closed = False
        self._namespaces: list[str] = []
        self._links: list[str] = []
        self.hosts: list[NetHost] = []
        cleanup_stale()
        existing = set(list_namespaces()) | set(list_links())
        with HostNetwork._lock:
            while True:  # skip names a dead process with our pid left behind
                serial = next(HostNetwork._serial)
                bridge, namespaces, veths = resource_names(self._owner, serial, n)
                if existing.isdisjoint([bridge, *namespaces, *veths]):
                    break
            self.subnet = ipaddress.IPv4Network(subnet) if subnet else self._pick_subnet(serial)
            HostNetwork._open.add(self)
            if not HostNetwork._atexit_registered:
                atexit.register(_close_all_at_exit)
                HostNetwork._atexit_registered = True
        if self.subnet.num_addresses < n + 2:
            self.close()
            raise ValueError(f"subnet {self.subnet} is too small for {n} hosts")
        self.bridge = bridge
        try:
            self._build(bridge, namespaces, veths, ifname)
        except BaseException:
            self.close()
            raise

    def _pick_subnet(self, serial: int) -> ipaddress.IPv4Network:
        used = _used_networks() + [net.subnet for net in HostNetwork._open]
        start = (self._owner * 7 + serial) % 254
        for offset in range(254):
            candidate = ipaddress.IPv4Network(f"{SUBNET_BASE}.{(start + offset) % 254 + 1}.0/24")
            if not any(candidate.overlaps(net) for net in used):
                return candidate
        raise RuntimeError(f"no free /24 in {SUBNET_BASE}.0.0/16")

    def _build(self, bridge: str, namespaces: list[str], veths: list[str], ifname: str) -> None:
        _ip("link", "add", bridge, "type", "bridge")
        self._links.append(bridge)
        _ip("link", "set", bridge, "addrgenmode", "none")
        _ip("link", "set", bridge, "up")
        prefix = self.subnet.prefixlen
        for index, (namespace, veth) in enumerate(zip(namespaces, veths)):
            _ip("netns", "add", namespace)
            self._namespaces.append(namespace)
            _ip("link", "add", veth, "type", "veth", "peer", "name", ifname, "netns", namespace)
            self._links.append(veth)
            _ip("link", "set", veth, "addrgenmode", "none")
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            addr = str(self.subnet.network_address + index + 1)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "link", "set", ifname, "addrgenmode", "none")
            _ip("-n", namespace, "addr", "add", f"{addr}/{prefix}", "dev", ifname)
            _ip("-n", namespace, "link", "set", ifname, "up")
            self.hosts.append(NetHost(self, index, namespace, addr, ifname, veth))

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"HostNetwork({len(self.hosts)} hosts, bridge={getattr(self, 'bridge', None)!r}, subnet={self.subnet}, {state})"

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    def close(self) -> None:
        """Kill every process in the hosts and delete the veths, namespaces and bridge.

        SIGKILLs the session of each process started with :meth:`NetHost.popen`, then every process
        ``ip netns pids`` still finds in a namespace (until none is left), reaps the started
        processes, closes their pipes, and deletes what was made. Best effort throughout; a second
        call does nothing. Only the creating process tears down (a forked child's exit does not).

        Raises:
            RuntimeError: If something could not be removed (named in the message).
        """
        with HostNetwork._lock:
            if self._closed or os.getpid() != self._owner:
                return
            self._closed = True
            HostNetwork._open.discard(self)
        procs = [proc for host in self.hosts for proc in host._procs]
        for proc in procs:
            _killpg(proc)
        survivors = {ns: _kill_namespace_processes(ns) for ns in self._namespaces}
        for proc in procs:
            try:
                proc.wait(timeout=KILL_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
        # veths before namespaces: deleting the root end removes the namespace's end at once, while a
        # deleted namespace is torn down by the kernel in the background.
        for link in reversed(self._links):
            if link != getattr(self, "bridge", None):
                _ip("link", "del", link, check=False)
        for namespace in self._namespaces:
            _ip("netns", "del", namespace, check=False)
        for link in self._links:
            if link == getattr(self, "bridge", None):
                _ip("link", "del", link, check=False)
        left = [ns for ns in self._namespaces if ns in set(list_namespaces())]
        left += [link for link in self._links if link in set(list_links())]
        alive = {ns: pids for ns, pids in survivors.items() if pids}
        if left or alive:
            raise RuntimeError(f"could not remove {left} (processes still alive: {alive})")


def _close_all_at_exit() -> None:
    """The atexit hook: close the networks the exiting process still has open."""
    for network in list(HostNetwork._open):
        try:
            network.close()
        except Exception as exc:  # noqa: BLE001 - report and go on with the others
            print(f"nethosts: {exc}", file=sys.stderr)


# --------------------------------------------------------------------------- capability


_reason_cache: list[str | None] = []


def unavailable_reason() -> str | None:
    """Why test hosts cannot be made here (one line), or None if they can; computed once.

    Checks Linux, root, the ``ip`` command, and then really makes and removes a one-host network
    (``ip netns add`` fails in an unprivileged container, veths may be missing from the kernel).
    """
    if _reason_cache:
        return _reason_cache[0]
    reason: str | None = None
    if not sys.platform.startswith("linux"):
        reason = f"network namespaces need Linux, not {sys.platform}"
    elif os.geteuid() != 0:
        reason = f"network namespaces need root (euid {os.geteuid()})"
    elif shutil.which("ip") is None and shutil.which("ip", path="/usr/sbin:/sbin") is None:
        reason = "iproute2's `ip` command is not installed"
    else:
        try:
            HostNetwork(1).close()
        except Exception as exc:  # noqa: BLE001 - any failure means no test hosts
            reason = f"cannot create network namespaces: {exc}"
    if reason is not None:
        reason = " ".join(reason.split())
    _reason_cache.append(reason)
    return reason


# --------------------------------------------------------------------------- pytest


if pytest is not None:

    @pytest.fixture
    def net_hosts() -> Iterator[Callable[..., list[NetHost]]]:
        """Factory of test hosts: ``net_hosts(n=2, subnet=None, ifname="eth0") -> list[NetHost]``.

        Each call makes a new :class:`HostNetwork` (reach it as ``hosts[0].network``); all are
        closed at teardown, whatever the test did. Skips the test where namespaces cannot be made
        (:func:`unavailable_reason`). Use it from a test module with
        ``from nethosts import net_hosts  # noqa: F401``.
        """
        reason = unavailable_reason()
        if reason is not None:
            pytest.skip(reason)
        networks: list[HostNetwork] = []

        def make(n: int = 2, *, subnet: str | None = None, ifname: str = DEFAULT_IFNAME) -> list[NetHost]:
            network = HostNetwork(n, subnet=subnet, ifname=ifname)
            networks.append(network)
            return network.hosts

        yield make
        errors: list[Exception] = []
        for network in reversed(networks):
            try:
                network.close()
            except Exception as exc:  # noqa: BLE001 - close the others first
                errors.append(exc)
        if errors:
            raise errors[0]
