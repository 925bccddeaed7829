"""The CUDA path on a GPU (marker ``gpu``; each test skips where torch sees no GPU, so CI stays green).

scripts/gpu_check.sh runs these on a lent machine (docs/gpu.md): the device choice and the memory
probe, a transfer and the codec keeping CUDA tensors on their device, CUDA RNG state carried, the
int64 fingerprints made on the device, a snapshot into pinned memory, and a 1-rank NCCL group aborted
while blocked and built again. With ``FTRUN_GPU_FIGURES`` set to a file, each test appends what it
measured there (one JSON object a line), which gpu_check.sh gathers into its JSON.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ftrun.common import contract
from ftrun.rank import cuda

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh, docs/gpu.md)")]


def record(name: str, **figures: object) -> None:
    path = os.environ.get("FTRUN_GPU_FIGURES")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"test": name, **figures}) + "\n")


def test_a_ranks_device_and_its_memory_probe() -> None:
    device, waited = cuda.bind_device("gloo", "cuda", 3, 3, respawned=False)
    assert device == torch.device(f"cuda:{3 % torch.cuda.device_count()}") and waited is None
    assert torch.cuda.current_device() == device.index
    probe = cuda.nvml_probe(device.index, predecessor_pid=None)
    look = probe()
    assert 0 < look.free <= look.total and look.predecessor is None
    gone = __import__("subprocess").Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process that held no GPU memory and is gone
    dead = gone.pid
    waited = cuda.wait_for_memory(cuda.nvml_probe(device.index, predecessor_pid=dead), timeout_s=10)
    assert waited.ready and waited.waited_s < 10
    record("memory_probe", free=look.free, total=look.total, wait_s=round(waited.waited_s, 3), how=waited.how)


@pytest.mark.parametrize("wire", ["cpu", "cuda"])
def test_a_transfer_keeps_cuda_tensors_on_the_recipients_gpu(wire: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a fake wire (no processes): staged through host memory (gloo) or on the GPU (NCCL), each
    received tensor is bitwise the sent one and on this rank's GPU; a GPU wire receives into the
    recipient's own tensors."""
    from ftrun.rank.transfer import recv_state, send_state

    torch.cuda.set_device(0)
    wire_device = "cpu" if wire == "cpu" else "cuda:0"
    state = {"w": torch.randn(64, 32, device="cuda"), "step": torch.tensor(7, device="cuda"), "host": torch.arange(4)}
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "send", lambda t, dst, group=None: sent.append(t.clone()))
    monkeypatch.setattr(dist, "recv", lambda t, src, group=None: t.copy_(sent.pop(0)))
    send_state(state, dst=1, device=wire_device)
    assert all(t.device == torch.device(wire_device) for t in sent)
    mine = {"w": torch.zeros(64, 32, device="cuda"), "step": torch.tensor(0, device="cuda"), "host": torch.zeros(4, dtype=torch.int64)}
    got, _ = recv_state(0, mine, device=wire_device)
    for key in state:
        assert got[key].device == state[key].device and torch.equal(got[key], state[key]), key
    if wire == "cuda":
        assert got["w"] is mine["w"] or got["w"].data_ptr() == mine["w"].data_ptr()  # in place, memory not doubled


def test_cuda_rng_state_travels_with_a_rank() -> None:
    from ftrun.rank.transfer import RNGState

    torch.cuda.manual_seed(1234)
    torch.cuda.init()
    rng = RNGState()
    saved = rng.state_dict()
    assert "cuda" in saved
    first = torch.rand(5, device="cuda")
    torch.cuda.manual_seed(99)
    rng.load_state_dict(saved)
    assert torch.equal(torch.rand(5, device="cuda"), first)


def test_fingerprints_on_the_gpu_are_int64_sums_made_there() -> None:
    """A CUDA tensor's fingerprint hashes the int64 (wrapping) sums of its bit patterns, computed on
    the GPU: they equal the CPU's sums of the same bits, the fingerprint is the same for the same
    bits, and one changed element changes it."""
    from ftrun.rank.digest import fingerprint, tensor_sums

    tensors = [torch.randn(1000, 37), torch.randint(-(1 << 62), 1 << 62, (300,), dtype=torch.int64),
               torch.randn(9, dtype=torch.float16), torch.randn(5, dtype=torch.bfloat16)]
    on_gpu = [t.cuda() for t in tensors]
    for t, g in zip(tensors, on_gpu):
        assert torch.equal(tensor_sums(g).cpu(), tensor_sums(t)), t.dtype
    assert fingerprint(on_gpu) == fingerprint([t.clone() for t in on_gpu])
    on_gpu[0][500, 3] += 1e-3
    assert fingerprint(on_gpu) != fingerprint([t.cuda() for t in tensors])


def test_a_snapshot_of_cuda_state_lands_in_pinned_memory_and_is_reused() -> None:
    from ftrun.common.checkpoint import snapshot

    state = {"w": torch.randn(4096, 1024, device="cuda"), "m": [torch.randn(1024, device="cuda")]}
    started = time.perf_counter()
    first = snapshot(state)
    first_s = time.perf_counter() - started
    assert first["w"].is_pinned() and torch.equal(first["w"], state["w"].cpu())
    state["w"].add_(1)
    started = time.perf_counter()
    again = snapshot(state, reuse=first)
    reused_s = time.perf_counter() - started
    assert again["w"].data_ptr() == first["w"].data_ptr() and torch.equal(again["w"], state["w"].cpu())
    nbytes = (4096 * 1024 + 1024) * 4
    record("snapshot_pinned", bytes=nbytes, first_s=round(first_s, 4), reused_s=round(reused_s, 4),
           reused_gb_s=round(nbytes / reused_s / 1e9, 2))


def _nccl_group() -> dist.ProcessGroup:
    from ftrun.rank.reducer import one_rank_group

    return one_rank_group(torch.device("cuda:0"), timeout_s=60)


def nccl_abort_scenario() -> dict[str, object]:
    """A 1-rank NCCL all-reduce queued behind a 3 s GPU spin (``torch.cuda._sleep``, its rate measured
    first) is blocked; the group is aborted from another thread after 0.5 s, as the I/O thread does
    (:func:`ftrun.rank.cuda.abort_group`); then a new group is built and all-reduces. Run in a process of
    its own (``python tests/test_gpu.py nccl-abort``), under a managed rank's NCCL settings.

    What blocks here is the compute kernel ahead of the collective, which no abort stops: on one GPU a
    collective cannot be made to wait for an absent peer (NCCL refuses two ranks on one device). So
    this shows how long ``abort()`` itself takes while the GPU is busy, when the wait ends and whether
    it raises; the release of a kernel waiting for a dead peer needs two GPUs."""
    for name, value in contract.NCCL_SETTINGS.items():
        os.environ.setdefault(name, value)
    torch.cuda.set_device(0)
    group = _nccl_group()
    x = torch.ones(1 << 20, device="cuda")
    group.allreduce([x]).wait()  # the communicator is made here
    torch.cuda.synchronize()
    started = time.perf_counter()
    torch.cuda._sleep(200_000_000)
    torch.cuda.synchronize()
    rate_hz = 200_000_000 / (time.perf_counter() - started)
    spin_s = 3.0
    torch.cuda._sleep(int(spin_s * rate_hz))
    work = group.allreduce([x])
    aborted: list[bool] = []
    abort_call_s: list[float] = []

    def abort() -> None:
        time.sleep(0.5)
        called = time.perf_counter()
        aborted.append(cuda.abort_group(group))
        abort_call_s.append(time.perf_counter() - called)

    started = time.perf_counter()
    thread = threading.Thread(target=abort, daemon=True)
    thread.start()
    raised = None
    try:
        work.wait()
    except Exception as err:  # noqa: BLE001  the aborted collective's failure, whatever torch names it
        raised = f"{type(err).__name__}: {str(err)[:200]}"
    released_s = time.perf_counter() - started
    thread.join(5)
    torch.cuda.synchronize()  # the spin ends on its own
    rebuilt_at = time.perf_counter()
    again = _nccl_group()
    y = torch.full((1024,), 2.0, device="cuda")
    again.allreduce([y]).wait()
    torch.cuda.synchronize()
    return {"aborted": aborted == [True], "abort_call_s": round(abort_call_s[0], 3) if abort_call_s else None,
            "released_s": round(released_s, 3), "spin_s": spin_s, "raised": raised,
            "rebuild_s": round(time.perf_counter() - rebuilt_at, 3),
            "rebuilt_ok": bool(torch.equal(y, torch.full((1024,), 2.0, device="cuda")))}


def test_a_one_rank_nccl_group_aborted_while_blocked_is_built_again() -> None:
    """:func:`nccl_abort_scenario` in a process of its own (a communicator that will not let go must
    not hang the suite): the blocked wait ends no later than 1 s after the 3 s spin, and the group
    built again all-reduces correctly. ``abort()``'s own time (it held its caller until the spin
    ended on an H200, torch 2.11: the I/O thread hands it to a thread of its own), the wait's time
    and its error are recorded as figures."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, __file__, "nccl-abort"], capture_output=True, text=True, timeout=90,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                                                         os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    record("nccl_abort", **found)
    assert found["aborted"], "ProcessGroup.abort() is missing from this torch"
    assert found["released_s"] < found["spin_s"] + 1.0, f"the aborted wait outlasted the GPU work ahead of it: {found}"
    assert found["rebuilt_ok"], found


if __name__ == "__main__" and sys.argv[1:] == ["nccl-abort"]:
    print(json.dumps(nccl_abort_scenario()), flush=True)
