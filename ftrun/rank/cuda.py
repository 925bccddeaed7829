"""A rank's CUDA path: its device, the release of a group blocked in a collective, the NCCL settings of
its environment, the wait for its GPU's memory after a kill, and what a spare knows of its GPU before
its promotion.

No torch at import.
The decisions are pure functions of their inputs (a backend, a device count, a clock, a memory
probe), so they are tested on a machine without a GPU; what touches CUDA or NCCL is a thin layer
(:func:`abort_group`, :func:`nvml_probe`, :func:`bind_device`) that runs on a GPU only.

- **Devices.** NCCL puts rank ``LOCAL_RANK`` on ``cuda:LOCAL_RANK`` (NCCL refuses two ranks on one
  GPU). gloo carries CUDA tensors too (``ftrun.init(backend="gloo", device="cuda")``): ranks then
  share the node's GPUs, ``cuda:(LOCAL_RANK mod GPUs)``, which is how 4 ranks run on one GPU.
- **Releasing a blocked collective.** A gloo group is released by shutting its TCP connections
  (:mod:`ftrun.rank.conns`); an NCCL group by aborting its communicators through torch's
  ``ProcessGroup.abort()`` (``ncclCommAbort``), from the control channel's I/O thread: the
  collective's work then fails and the step loop recovers (:func:`release_for`).
- **NCCL's watchdog.** torch's default ends a process whose collective times out or errors
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) and its heartbeat monitor ends one whose watchdog is stuck:
  either would kill a survivor ftrun is recovering. A managed rank's environment gets
  :data:`ftrun.common.contract.NCCL_SETTINGS` unless the user set them
  (:func:`ftrun.common.contract.nccl_environment`, which the node's spawner calls).
- **A GPU's memory after a kill.** A rank respawned on the GPU of a process just killed may find
  that process's memory not yet freed by the driver (NVIDIA's resiliency extension waits up to
  50 s for it). A respawned rank waits, at most :data:`MEMORY_WAIT_S`, until its predecessor holds no
  memory on the GPU (NVML's process list), or, where NVML cannot tell, until the free memory has
  stopped growing for :data:`MEMORY_SETTLE_S` (:func:`wait_for_memory`); the wait is written to its log.
- **Spares.** A hot spare's GPU is known before its promotion only when every rank of its node
  shares one (one GPU, or a CPU job): it then builds its CUDA context while it waits. With one
  GPU per rank its device comes with its rank, and its promotion pays the CUDA context (seconds)
  (:func:`spare_device`).
"""

from __future__ import annotations

import enum
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ftrun.common.contract import PREVIOUS_PID  # the predecessor's pid in a respawned rank's environment (its agent sets it)

MEMORY_WAIT_S = 60.0  # the longest a respawned rank waits for its GPU's memory (NVRx: up to 50 s)
MEMORY_SETTLE_S = 0.5  # without NVML: free memory unchanged this long means the driver has let go
MEMORY_POLL_S = 0.1


# ----------------------------------------------------------------------------- devices
def choose_device(backend: str, requested: str | None, local_rank: int, device_count: int) -> str:
    """The device of a rank, as torch names it (``"cpu"``, ``"cuda:1"``).

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        requested: ``ftrun.init``'s ``device``: None (NCCL: the rank's GPU; gloo: the CPU), ``"cpu"``,
            ``"cuda"`` (the rank's GPU, shared round-robin when ranks outnumber GPUs: gloo only) or
            ``"cuda:N"``.
        local_rank: the rank's index on its node.
        device_count: the GPUs this process sees.

    Raises:
        ValueError: a CUDA device asked for where there is none, NCCL on the CPU, or two NCCL
            ranks on one GPU (NCCL refuses them).
    """
    want = requested or ("cuda" if backend == "nccl" else "cpu")
    if want == "cpu":
        if backend == "nccl":
            raise ValueError("ftrun: NCCL carries CUDA tensors only: device='cpu' needs backend='gloo'")
        return "cpu"
    if not want.startswith("cuda"):
        raise ValueError(f"ftrun: device {requested!r} is neither 'cpu' nor 'cuda[:N]'")
    if device_count < 1:
        raise ValueError(f"ftrun: device {want!r} asked for, but this process sees no GPU")
    if want != "cuda":
        index = int(want.split(":", 1)[1])
        if index >= device_count:
            raise ValueError(f"ftrun: device {want!r} asked for, but this process sees {device_count} GPU(s)")
        return want
    if backend == "nccl" and local_rank >= device_count:
        raise ValueError(f"ftrun: NCCL needs a GPU per rank on a node: LOCAL_RANK {local_rank}, {device_count} GPU(s) "
                         "(gloo shares GPUs: backend='gloo', device='cuda')")
    return f"cuda:{local_rank % device_count}"


def spare_device(backend: str, requested: str | None, device_count: int) -> str | None:
    """A spare's device before its promotion, or None when only its rank tells (one GPU per rank).
    Known when every rank of the node shares one device: a CPU job, or a single GPU shared over gloo
    (NCCL cannot put two ranks on one GPU, so an NCCL spare never knows it in advance)."""
    want = requested or ("cuda" if backend == "nccl" else "cpu")
    if want == "cpu":
        return "cpu"
    if want != "cuda":
        return want  # one named device for every rank
    if backend != "nccl" and device_count == 1:
        return "cuda:0"
    return None


class Release(enum.Enum):
    """How a group blocked in a collective is released (:func:`release_for`)."""

    CUT_CONNECTIONS = "cut"  # gloo: shut the group's TCP connections (ftrun.rank.conns)
    ABORT_COMMUNICATORS = "abort"  # NCCL: torch's ProcessGroup.abort() (ncclCommAbort)


def release_for(backend: str) -> Release:
    """The release of a group of ``backend`` (gloo carries CUDA tensors over its TCP connections too)."""
    return Release.ABORT_COMMUNICATORS if backend == "nccl" else Release.CUT_CONNECTIONS


def abort_group(group: Any) -> bool:
    """Abort ``group``'s communicators through torch's ``ProcessGroup.abort()`` (NCCL's
    ``ncclCommAbort``): a collective blocked on it, in any thread, fails. Safe from another
    thread than the one blocked. False if there is no group or this torch has no ``abort``."""
    if group is None:
        return False
    abort = getattr(group, "abort", None)  # ProcessGroup.abort: torch 2.6 and later
    if abort is None:
        return False
    abort()
    return True


def wire_device(backend: str) -> str:
    """The device a state transfer travels on: this rank's current GPU with NCCL (which carries CUDA
    tensors only), the CPU with gloo (whose send and receive take CPU tensors; CUDA state is staged
    through host memory, and each received tensor goes back to its device: :func:`placement`)."""
    if backend != "nccl":
        return "cpu"
    import torch

    return f"cuda:{torch.cuda.current_device()}"


def placement(ref_device: str, local_cuda: str | None) -> str:
    """Where a received tensor goes: a CPU tensor stays on the CPU; a CUDA one (the donor's
    ``cuda:N``, as the codec recorded it) goes to this rank's own GPU ``local_cuda`` (a donor's
    GPU index means nothing here), or stays on the CPU where this process has none."""
    if ref_device.startswith("cuda") and local_cuda is not None:
        return local_cuda
    return "cpu" if ref_device.startswith("cuda") else ref_device


# ----------------------------------------------------------------------------- a GPU's memory
@dataclass(frozen=True)
class DeviceMemory:
    """One look at a GPU's memory, in bytes. ``predecessor``: what the rank's previous process still
    holds there (None: NVML cannot tell: no NVML, no process list, or no predecessor known)."""

    free: int
    total: int
    predecessor: int | None = None


@dataclass(frozen=True)
class MemoryWait:
    """The outcome of :func:`wait_for_memory`: seconds waited, whether the memory came back (False:
    the wait ran out, and the rank goes on: it may then fail to allocate and be respawned again),
    the last look, and how it was judged (``"predecessor"``: NVML saw the previous process go;
    ``"settled"``: free memory stopped growing; ``"timeout"``)."""

    waited_s: float
    ready: bool
    last: DeviceMemory
    how: str

    def line(self, rank: int, device: str) -> str:
        gib = 1 << 30
        state = "ready" if self.ready else f"not freed after {self.waited_s:.1f} s; going on"
        return (f"ftrun: rank {rank}: {device} memory {state} (waited {self.waited_s:.2f} s, {self.how}; "
                f"free {self.last.free / gib:.1f} of {self.last.total / gib:.1f} GiB)")


def wait_for_memory(probe: Callable[[], DeviceMemory], timeout_s: float = MEMORY_WAIT_S,
                    settle_s: float = MEMORY_SETTLE_S, poll_s: float = MEMORY_POLL_S,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> MemoryWait:
    """Wait until a respawned rank's GPU has let go of its predecessor's memory, at most ``timeout_s``.

    Ready when the probe sees the predecessor hold nothing; where it cannot tell, when the free
    memory has not grown for ``settle_s`` (the driver is no longer returning memory). Time is an
    input (``clock``, ``sleep``), so the loop is tested with a fake clock and a fake probe."""
    start = clock()
    last = probe()
    best, best_at = last.free, start
    while True:
        now = clock()
        if last.predecessor is not None:
            if last.predecessor == 0:
                return MemoryWait(now - start, True, last, "predecessor")
        elif now - best_at >= settle_s:
            return MemoryWait(now - start, True, last, "settled")
        if now - start >= timeout_s:
            return MemoryWait(now - start, False, last, "timeout")
        sleep(poll_s)
        last = probe()
        if last.free > best:
            best, best_at = last.free, clock()


def nvml_probe(device_index: int, predecessor_pid: int | None) -> Callable[[], DeviceMemory]:
    """A probe of CUDA device ``device_index`` through NVML (``pynvml``, from nvidia-ml-py), with no
    CUDA context made; through ``torch.cuda.mem_get_info`` (which makes one) where NVML is missing.
    The predecessor's memory is read from NVML's compute processes; an empty list says nothing
    (a container may hide other processes), and neither does a missing predecessor pid."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        handle = _nvml_handle(pynvml, device_index)
    except Exception:  # no NVML (or no driver): torch's view, which cannot see processes
        import torch

        def torch_probe() -> DeviceMemory:
            free, total = torch.cuda.mem_get_info(device_index)
            return DeviceMemory(int(free), int(total), None)

        return torch_probe

    def probe() -> DeviceMemory:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        held = None
        if predecessor_pid is not None:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            if procs:
                held = sum(int(p.usedGpuMemory or 0) for p in procs if p.pid == predecessor_pid)
        return DeviceMemory(int(info.free), int(info.total), held)

    return probe


def _nvml_handle(pynvml: Any, device_index: int) -> Any:
    """NVML's handle of CUDA device ``device_index`` (by UUID: CUDA's and NVML's orders may differ)."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    if uuid is not None:
        return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}".encode())
    return pynvml.nvmlDeviceGetHandleByIndex(device_index)


def bind_device(backend: str, requested: str | None, local_rank: int, rank: int, respawned: bool,
                environ: Mapping[str, str] = os.environ) -> tuple[Any, MemoryWait | None]:
    """A rank's ``torch.device``, made current for CUDA, and, for a respawned rank on a GPU, its
    wait for the GPU's memory (its line written to the rank's log). Raises ``ValueError`` as
    :func:`choose_device` does."""
    import torch

    count = torch.cuda.device_count() if (requested or backend == "nccl") and requested != "cpu" else 0
    device = torch.device(choose_device(backend, requested, local_rank, count))
    waited = None
    if device.type == "cuda":
        if respawned:
            pid = environ.get(PREVIOUS_PID)
            waited = wait_for_memory(nvml_probe(device.index or 0, int(pid) if pid else None))
            print(waited.line(rank, str(device)), file=sys.stderr, flush=True)
        torch.cuda.set_device(device)
    return device, waited
