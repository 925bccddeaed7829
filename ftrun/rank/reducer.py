"""Gradient averaging during ``backward()``, over ftrun's rebuildable process group (DDP semantics).

After ``loss.backward()`` every rank holds the gradients averaged over the world, exactly as under
``DistributedDataParallel``, so ``clip_grad_norm_``, ``GradScaler.unscale_`` and gradient logging
between backward and step see what they would see under DDP. The idea is TorchFT's (torchft/ddp.py):
DDP's bucketing and comm hook, with the all-reduce issued on a group that can be rebuilt after a
fault, and a failed all-reduce recorded as state instead of raised through autograd.

One engine (:class:`GradientReducer`) for both ways in: a hook on each parameter marks it ready; a
bucket whose gradients are all ready is flattened, divided by the world size and all-reduced
asynchronously (overlapping with the rest of backward); a callback queued at the end of backward
waits for every bucket and copies the averages back into ``.grad``. With ``wrap_model(model,
ddp=True)`` the model is also wrapped in DDP over a private one-rank group (for ``no_sync()``,
``model.module``, DDP's hooks) with ``gradient_as_bucket_view=True`` and a comm hook that
communicates nothing: its bucket views are the ``.grad`` tensors, end to end in the bucket's order,
so this reducer all-reduces them in place, with no flat copy and no copy back (the two
copies were a tenth of a larger model's extra step time). So the two paths run the same all-reduces on the same layout: the same bits. (A DDP comm hook
doing the all-reduce itself would inherit DDP's per-process bucket history: a respawned rank's DDP
starts with one bucket while its peers' have been rebuilt, and gloo fails on the size mismatch.)

Bucket layout is DDP's (torch 2.13, :class:`BucketLayout`). By default the first backward reduces
one bucket holding every parameter in registration order; from the second on, parameters are
bucketed in the order their gradients became ready in the first backward, the first bucket capped
at ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) and the others at 25 MiB
(``dist._compute_bucket_assignment_by_size``, as DDP's reducer rebuilds its buckets). With
``find_unused_parameters=True`` DDP never rebuilds: its buckets are the registration order's,
capped from the start, the last parameters' bucket first; a parameter no rank used keeps its
``.grad`` untouched, and one this rank did not use but another did gets the average (a used-map
all-reduce per synced backward, as DDP's ``local_used_map``). Ring all-reduce sums each element in
an order that depends on where it sits in the buffer, so the same layout is what makes the plain
path, the DDP path and a plain DDP run under torchrun bitwise equal.

Errors: an all-reduce that raises (a dead peer, a connection cut by an abort) is recorded with
:attr:`GradientReducer.error`; the remaining buckets of that backward are not communicated;
``backward()`` returns normally and the optimizer wrapper skips the update (the step is computed
again from its forward, so a bucket reduced in place, part averaged, is never used). An in-place
all-reduce given up on while still in flight could write into a later step's gradients: the next
step waits for it to end (:meth:`GradientReducer.settle`).
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ftrun.rank.digest import Fingerprint
from ftrun.errors import describe

BUCKET_CAP_BYTES = 25 << 20  # DDP's default bucket_cap_mb (25 MiB)
_MIB = 1024 * 1024

# DDP keywords that cannot give DDP's bits over ftrun's rebuildable group: the value DDP takes by
# default (accepted) and why any other is refused.
_REFUSED_DDP_KEYWORDS: dict[str, tuple[Any, str]] = {
    "process_group": (None, "ftrun owns the process group (it is rebuilt after each fault)"),
    "device_mesh": (None, "ftrun owns the process group (it is rebuilt after each fault)"),
    "static_graph": (False, "its first iteration's delayed all-reduce and bucket rebuild are not reproduced; leave it out "
                            "(it only saves time)"),
    "mixed_precision": (None, "its reduced-precision copies are not reproduced; use torch.autocast"),
    "delay_all_reduce_named_params": (None, "delayed all-reduces are not reproduced"),
    "param_to_hook_all_reduce": (None, "delayed all-reduces are not reproduced"),
    "skip_all_reduce_unused_params": (False, "DDP's reduction of unused parameters is what ftrun reproduces"),
}


@dataclass(frozen=True)
class BucketLayout:
    """Which buckets DDP's reducer (torch 2.13) forms, for the keywords it was given.

    Attributes:
        find_unused_parameters: DDP's keyword: buckets are fixed at construction (capped, the last
            parameters' bucket first) and never rebuilt; a used-map all-reduce decides which
            ``.grad`` receive the average.
        first_cap: bytes of the first bucket (1 MiB with the default ``bucket_cap_mb``; the cap
            itself when ``bucket_cap_mb`` is given).
        cap: bytes of every other bucket (``bucket_cap_mb`` in MiB; 25 by default).
        caps: one cap per bucket (``bucket_cap_mb_list``), or empty.
    """

    find_unused_parameters: bool = False
    first_cap: int = dist._DEFAULT_FIRST_BUCKET_BYTES
    cap: int = BUCKET_CAP_BYTES
    caps: tuple[int, ...] = ()

    @classmethod
    def from_ddp_kwargs(cls, kwargs: dict[str, Any]) -> "BucketLayout":
        """The layout DDP builds from ``kwargs`` (the keywords given to ``wrap_model(ddp=True)``).

        Raises:
            ValueError: a keyword ftrun cannot honour bit for bit (one line naming it and why), or
                ``init_sync=False`` (every replica starts from rank 0's weights under ftrun).
        """
        for key, (default, why) in _REFUSED_DDP_KEYWORDS.items():
            if key in kwargs and kwargs[key] is not default and kwargs[key] != default:
                raise ValueError(f"ft.wrap_model(ddp=True) does not take {key}={kwargs[key]!r}: {why}")
        if kwargs.get("init_sync", True) is False:
            raise ValueError("ft.wrap_model(ddp=True) does not take init_sync=False: every replica starts from rank 0's "
                             "weights under ftrun (a respawned rank takes them from a replica)")
        cap_mb = kwargs.get("bucket_cap_mb")
        caps = tuple(int(c * _MIB) for c in kwargs.get("bucket_cap_mb_list") or ())
        cap = int(cap_mb * _MIB) if cap_mb is not None else BUCKET_CAP_BYTES
        if caps:
            cap = max(caps)
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if cap_mb is None and not caps else cap
        return cls(bool(kwargs.get("find_unused_parameters", False)), first, cap, caps)

    @property
    def rebuilds(self) -> bool:
        """Whether DDP rebuilds its buckets after the first backward (not with unused parameters)."""
        return not self.find_unused_parameters

    def initial(self, params: Sequence[torch.Tensor]) -> list[list[int]]:
        """The buckets of the first backward (of every backward when it never rebuilds)."""
        if not self.find_unused_parameters:
            return [list(range(len(params)))]
        limits = list(self.caps) or ([self.first_cap, self.cap] if self.first_cap < self.cap else [self.cap])
        buckets, _ = dist._compute_bucket_assignment_by_size(list(params), limits, [False] * len(params))
        return [list(b) for b in reversed(buckets)]

    def rebuilt(self, params: Sequence[torch.Tensor], order: list[int]) -> list[list[int]]:
        """The buckets after the first backward, from the order its gradients became ready."""
        seen = set(order)
        order = list(order) + [i for i in reversed(range(len(params))) if i not in seen]
        limits = list(self.caps) or [self.first_cap, self.cap]
        buckets, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], limits, [False] * len(params), order)
        return [list(b) for b in buckets]



# After an abort, how long a pending all-reduce gets to fail by itself (the abort's connection cut
# fails it within milliseconds). Leaving one in flight is safe: its group is never destructed
# (ftrun.rank.group.TrainingGroup.drop) and a late failure cannot touch a later pass (no callback is
# attached to it: see launch). It must stay well inside the coordinator's deadline for answering
# the abort (REPORT_DEADLINE_S, 10 s).
class LayoutSchedule:
    """Which of DDP's bucket layouts each synced backward of one model uses, as DDP decides it: the
    initial layout (:meth:`BucketLayout.initial`) in the job's first step until the forward after
    that model's first synced backward, the layout rebuilt from the order its gradients became
    ready (:meth:`BucketLayout.rebuilt`) after; a rank that starts later (respawned, resumed) learns
    the ready order in its first pass.

    Args:
        layout: the model's bucket layout.
        params: its parameters that take gradients, in registration order.
        is_first_step: whether the current step is the job's first (DDP's one-bucket iteration).

    Attributes:
        fixed: the first backward's buckets (every one's if never rebuilt).
        rebuilt: the buckets by ready order, once known; ready_order: recorded until then.
    """

    def __init__(self, layout: BucketLayout, params: Sequence[torch.Tensor], is_first_step: Callable[[], bool]) -> None:
        self.layout = layout
        self.params = params
        self.is_first_step = is_first_step
        self.fixed = layout.initial(params)
        self.rebuilt: list[list[int]] | None = None
        self.ready_order: list[int] = []
        # In the job's first step: a synced pass used the initial layout (the rebuild is due at the
        # next forward), and that forward came (the rest of the step uses the rebuilt layout).
        self.rebuild_due = False
        self.left_initial = False
        self._index_of: dict[int, int] = {}  # parameter index -> its bucket in _indexed
        self._indexed: list[list[int]] | None = None

    def begin_step(self) -> None:
        """A step (or a retry of one) starts: in the job's first step the initial layout holds
        again until this model's first synced backward and the forward after it."""
        self.rebuild_due = self.left_initial = False

    def on_forward(self) -> None:
        """A forward of the model with gradients enabled: DDP rebuilds its buckets here once its
        first synced backward recorded the order its gradients became ready."""
        if self.rebuild_due:
            self.rebuild_due, self.left_initial = False, True

    def initial(self) -> bool:
        """Whether this pass uses the initial layout: the job's first step, before the rebuild."""
        return not self.layout.rebuilds or (self.is_first_step() and not self.left_initial)

    def during_pass(self) -> tuple[list[list[int]], bool]:
        """The buckets that leave during this pass, and whether every bucket is deferred to its end
        (a rank that has not seen a backward yet: it learns the ready order from this pass)."""
        if self.initial():
            return self.fixed, False
        if self.rebuilt is not None:
            return self.rebuilt, False
        return [], True

    def bucket_of(self, buckets: list[list[int]]) -> dict[int, int]:
        """Parameter index -> its bucket in ``buckets`` (kept while the layout stays the same)."""
        if self._indexed is not buckets:
            self._indexed = buckets
            self._index_of = {j: b for b, bucket in enumerate(buckets) for j in bucket}
        return self._index_of

    def at_pass_end(self) -> list[list[int]]:
        """End of a synced backward: learn the rebuilt layout from its ready order, mark the rebuild
        due after an initial pass, and return the layout a deferred pass's buckets take."""
        if self.layout.rebuilds and self.rebuilt is None and self.ready_order:
            self.rebuilt = self.layout.rebuilt(self.params, self.ready_order)
        initial = self.initial()
        if initial and self.layout.rebuilds:
            self.rebuild_due = True
        return self.fixed if initial else (self.rebuilt or self.fixed)


class LocalGradientCheck:
    """The exactly-once check of a backward pass's local gradient: its fingerprint, taken from each
    bucket's flat copy as it is launched, before it is divided (buckets launch in their layout's
    order, which every computation of a step shares: the all-reduces of all ranks must match, so a
    recomputed step gets the same fingerprint), handed once per pass to ``on_local_gradient``.

    Args:
        on_local_gradient: takes the fingerprint; False fails a held pass (None: no check).
        hold_for_check: whether a pass must not communicate before the check.
    """

    def __init__(self, on_local_gradient: Callable[[str], bool] | None, hold_for_check: Callable[[], bool]) -> None:
        self.on_local_gradient = on_local_gradient
        self.hold_for_check = hold_for_check
        self.fingerprint: Fingerprint | None = None
        self.checked = False  # on_local_gradient has seen this pass's fingerprint

    def new_pass(self) -> None:
        """A backward pass begins: a new fingerprint, not checked yet."""
        self.checked = False
        self.fingerprint = Fingerprint(describe=False) if self.on_local_gradient is not None else None

    def holds(self) -> bool:
        """Whether this pass launches nothing before its local gradient is checked."""
        return self.on_local_gradient is not None and self.hold_for_check()

    def hand_on(self) -> bool:
        """Hand the pass's fingerprint to ``on_local_gradient``, once; False when it refused it."""
        if self.checked or self.fingerprint is None or self.on_local_gradient is None:
            return True
        self.checked = True
        return bool(self.on_local_gradient(self.fingerprint.hexdigest()))


ABANDON_GRACE_S = 1.0
ABANDON_POLL_S = 0.02  # how often a wait for an all-reduce looks at the abandon flag
ABANDONED = "abandoned: the job's coordinator aborted this generation"


def wait_out(work: Any, abandon: threading.Event, poll: timedelta) -> str:
    """Wait for ``work``, looking at ``abandon`` every ``poll``: "returned" (it completed),
    "ended" (it failed, or completed right after a wait timed out, a race seen under load: a wait
    on it says which), or "abandoned" (an abort for a newer generation arrived: the abort's release
    normally fails the work at once; it is given :data:`ABANDON_GRACE_S` for that, then left)."""
    abandoned_at = None
    while True:
        try:
            work.wait(poll)
            return "returned"
        except Exception:
            if work.is_completed():
                return "ended"
        if abandon.is_set():
            abandoned_at = abandoned_at or time.monotonic()
            if time.monotonic() - abandoned_at > ABANDON_GRACE_S:
                return "abandoned"


class GradientReducer:
    """Averages the gradients of ``params`` over ftrun's group while backward runs.

    Args:
        params: the model's parameters, in registration order (``model.parameters()``).
        world_size: ranks the gradients are averaged over.
        before_first_bucket: called on the training thread when a backward launches its first
            bucket (the worker marks its step board ``collective`` and fires the ``allreduce`` fault
            point there); an exception it raises is handled by ``on_hook_error``.
        is_failed: whether the step has already failed (nothing more is communicated).
        on_hook_error: called with an exception raised by ``before_first_bucket``,
            ``at_pass_start`` or ``after_last_bucket``; returns True if it was recorded (a
            recoverable error), False to let it propagate out of ``backward()``.
        on_failure: called at the end of a backward whose all-reduce failed, with the error.
        is_first_step: whether the current step is the job's first (DDP's one-bucket iteration);
            a rank that starts later (respawned, resumed) must use the rebuilt layout its peers use.
            Within the first step, as in DDP, a model's first synced backward uses the initial
            layout and its buckets are rebuilt at its next forward with gradients enabled
            (:meth:`LayoutSchedule.on_forward`), so a step holding several backward passes (a GAN's) uses the
            rebuilt layout from its second on; a retried first step starts over
            (:meth:`LayoutSchedule.begin_step`).
        waiting: a flag the worker's heartbeat probe reads (set while this thread waits for an
            all-reduce, so the watchdog knows the rank waits in torch.distributed).
        on_local_gradient: called once per synced backward, before its last bucket leaves, with
            the fingerprint of the local gradients (before averaging: :class:`ftrun.rank.digest.Fingerprint`
            of each bucket's flat tensor as it leaves, in the layout's order); returns False to
            fail the step instead (see ``hold_for_check``). The worker keeps and compares it
            (exactly-once check).
        at_pass_start: called on the training thread when a synced backward's first gradient is
            ready, before any bucket leaves: the worker writes the rank's provisional record there
            (no peer can commit the step before this rank's last bucket arrives). Made
            right before the last bucket instead, the same record cost word_lm's small steps 4 to 7%
            of their time against 2 to 3.5% here (``scripts/ablate_steps.py``): there every rank
            waits for it.
        after_last_bucket: called on the training thread right after a backward's last bucket was
            launched, while the all-reduce runs: the worker writes the local gradient's
            fingerprint (``on_local_gradient`` has it by then) for a successor that recomputes
            the step.
        hold_for_check: whether this pass must not communicate before ``on_local_gradient`` has
            seen the fingerprint (a recomputed step under ``--on_divergence fail``): every bucket
            is then launched at the end of backward, after the check.
        abandon: set (by the worker's I/O thread) when an abort for a newer generation arrived:
            a wait in progress gives up (the step fails and is recovered) instead of trusting the
            backend to fail an all-reduce whose peer is gone (seen in CI: a future that never
            completed after the connections were cut).
        layout: DDP's bucket layout for the keywords the model was wrapped with.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        world_size: int,
        before_first_bucket: Callable[[], None],
        is_failed: Callable[[], bool],
        on_hook_error: Callable[[BaseException], bool],
        on_failure: Callable[[str], None],
        waiting: threading.Event,
        is_first_step: Callable[[], bool] = lambda: True,
        abandon: threading.Event | None = None,
        on_local_gradient: Callable[[str], bool] | None = None,
        hold_for_check: Callable[[], bool] = lambda: False,
        layout: BucketLayout = BucketLayout(),
        at_pass_start: Callable[[], None] = lambda: None,
        after_last_bucket: Callable[[], None] = lambda: None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.layout = layout
        # Which layout each pass uses; told of each step's start and each forward (begin_step, on_forward).
        self.schedule = LayoutSchedule(layout, self.params, is_first_step)
        self._used: set[int] = set()  # parameters with a gradient since the last synced backward
        self.world_size = world_size
        self._before_first_bucket = before_first_bucket
        self._at_pass_start = at_pass_start
        self._after_last_bucket = after_last_bucket
        self._is_failed = is_failed
        self._on_hook_error = on_hook_error
        self._on_failure = on_failure
        self._abandon = abandon
        self._waiting = waiting
        self.error: str | None = None  # "Type: message" of the first failed all-reduce of this backward
        self.sync = True  # False inside no_sync(): gradients accumulate locally
        # The DDP path: whether the last forward ran outside DDP's own no_sync(). DDP decides at
        # forward time whether the next backward communicates; a forward pre-hook on the DDP
        # module keeps this in step (see Worker.wrap_model).
        self.forward_sync = True
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._check = LocalGradientCheck(on_local_gradient, hold_for_check)  # the pass's fingerprint and its check
        self._hooks: list[Any] = []
        # Works of in-place buckets that a pass gave up on while they ran (an abort): until each has
        # completed or failed, gloo may still write into the .grad tensors (see settle).
        self._unsettled: list[Any] = []
        self._bucket_of: dict[int, int] = {}  # parameter index -> its bucket in this pass's layout
        self._views = False  # whether .grad may be DDP's bucket views (attach(after_ddp=True))
        self._reset_pass()

    # ---------------------------------------------------------------- plain-model path
    def attach(self, after_ddp: bool = False) -> None:
        """Install the hooks that mark each parameter's gradient ready.

        ``after_ddp``: the parameters were just wrapped in DDP (``wrap_model(ddp=True)``). The
        hooks then go on the gradient accumulators, after DDP's own: DDP's hook makes a new
        ``.grad`` one of its bucket views (a copy), and a bucket whose gradients are all views
        already is reduced in place (:meth:`_flatten`). A post-accumulate-grad hook would run
        before DDP's, on the gradient not yet moved."""
        self._views = after_ddp
        if not after_ddp:
            for p in self.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
            return
        with torch.enable_grad():
            for p in self.params:
                accumulator = p.view_as(p).grad_fn.next_functions[0][0]
                self._hooks.append(accumulator)  # kept alive: a new one would have no hook
                accumulator.register_hook(functools.partial(self._mark_ready, self._index[id(p)]))

    def _reset_pass(self) -> None:
        # Which backward pass this is: an all-reduce abandoned in an earlier pass (its group torn
        # down under it) may fail long after, and must not mark a later, healthy pass failed.
        self._pass = getattr(self, "_pass", 0) + 1
        # (bucket, its flat buffer, its all-reduce's work or None, whether the buffer is the .grad
        # tensors themselves: DDP's bucket views, reduced in place)
        self._pending: list[tuple[list[int], torch.Tensor, Any, bool]] = []
        self._side: list[Any] = []  # the works of other all-reduces of the pass (the used map)
        self._ready: set[int] = set()
        self._missing: list[int] = []  # per bucket of this pass's layout, its gradients not ready yet
        self._next_bucket = 0
        self._started = False
        self._callback_queued = False
        self._buckets: list[list[int]] | None = None  # chosen at the pass's first ready gradient
        self._deferred = False
        self._held = False  # this pass launches nothing before the local gradient is checked
        self._check.new_pass()

    def _choose_layout(self) -> None:
        """DDP's layout for this pass: one bucket on the job's first step; the rebuilt buckets after;
        a rank that starts later and has not seen a backward yet defers every bucket to the end of
        this pass, when it knows the ready order (same layout as its peers, no overlap once)."""
        if self._check.holds():
            self._buckets, self._deferred, self._held = [], True, True
        else:
            self._buckets, self._deferred = self.schedule.during_pass()
        # Per bucket, how many of its gradients are not ready yet (a count, not a scan of the
        # bucket at every hook: that was quadratic in a bucket's parameters).
        self._bucket_of = self.schedule.bucket_of(self._buckets)
        self._missing = [len(bucket) for bucket in self._buckets]

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._mark_ready(self._index[id(param)])

    def _mark_ready(self, i: int, *_hook_args: Any) -> None:
        """Parameter ``i``'s gradient is ready (the accumulator hook's inputs and outputs ignored).
        Runs once per parameter and backward, so it makes as few calls as it can."""
        if self.layout.find_unused_parameters:
            self._used.add(i)  # no_sync passes count too, as in DDP's local_used_map
        if not (self.sync and self.forward_sync) or self.world_size == 1:
            return
        if not self._callback_queued:
            self._begin_pass()
        if self._buckets is None:
            self._choose_layout()
        if i in self._ready:  # accumulated twice in one backward (reentrant checkpointing)
            return
        if self.schedule.rebuilt is None and self.layout.rebuilds:
            self.schedule.ready_order.append(i)
        self._ready.add(i)
        assert self._buckets is not None
        if not self._buckets:
            return  # deferred or held: every bucket leaves at the end of backward
        self._missing[self._bucket_of[i]] -= 1
        while self._next_bucket < len(self._buckets) and self._missing[self._next_bucket] == 0:
            self._launch_bucket(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def _flatten(self, bucket: list[int]) -> tuple[torch.Tensor, bool]:
        """``bucket``'s gradients as one flat tensor, in order, and whether it is the ``.grad``
        tensors themselves: when they lie end to end in one storage, in the bucket's order (DDP's
        bucket views under ``wrap_model(ddp=True)``), a view of them, reduced in place as DDP
        does; else a new copy (zeros for a parameter without a gradient)."""
        grads = [self.params[j].grad for j in bucket]
        view = self._bucket_view(grads)
        if view is not None:
            return view, True
        if len(bucket) == 1:
            only = grads[0] if grads[0] is not None else torch.zeros_like(self.params[bucket[0]])
            return only.reshape(-1).clone(), False
        return torch.cat([
            (g if g is not None else torch.zeros_like(self.params[j])).reshape(-1)
            for j, g in zip(bucket, grads)
        ]), False

    def _bucket_view(self, grads: list[torch.Tensor | None]) -> torch.Tensor | None:
        """One flat view of ``grads`` if they lie end to end in one storage, in order; else None.
        Only for DDP's bucket views (a plain model's gradients are separate tensors: a bucket of
        one would gain little); not with ``find_unused_parameters`` (a gradient no rank produced
        must stay untouched), nor while an all-reduce of an earlier pass may still write into them
        (:meth:`settle`)."""
        if not self._views or self.layout.find_unused_parameters or self._unsettled:
            return None
        first = grads[0]
        if first is None:
            return None
        storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
        for g in grads:
            if (g is None or not g.is_contiguous() or g.dtype != first.dtype or g.device != first.device
                    or g.untyped_storage().data_ptr() != storage or g.storage_offset() != offset):
                return None
            offset += g.numel()
        return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())

    def _launch_bucket(self, bucket: list[int], flat: tuple[torch.Tensor, bool] | None = None) -> None:
        """Flatten ``bucket`` (unless ``flat`` is given: the held pass flattened it already), add
        it to the local gradient's fingerprint, and start its all-reduce; before the pass's last
        bucket, hand the fingerprint on, and call ``after_last_bucket`` once it has left."""
        self._start_collectives()
        if flat is None:
            flat, in_place = self._flatten(bucket)
            if self._check.fingerprint is not None:
                self._check.fingerprint.update(flat)  # before launch() divides it in place
        else:
            flat, in_place = flat
        last = bool(self._buckets) and bucket is self._buckets[-1]
        if last:
            self._check_local_gradient()
        self._pending.append((bucket, flat, self.launch(flat), in_place))
        if last:
            self._guarded(self._after_last_bucket)

    def _check_local_gradient(self) -> None:
        """Hand the pass's local-gradient fingerprint to ``on_local_gradient``, once."""
        if not self._check.hand_on() and self._held and self.error is None:
            self.error = "held back: this rank's recomputed step diverged (--on_divergence fail)"

    def _start_collectives(self) -> None:
        """Before the pass's first all-reduce: ``before_first_bucket``, once."""
        if not self._started:
            self._started = True
            self._guarded(self._before_first_bucket)

    def _guarded(self, callback: Callable[[], None]) -> None:
        try:
            callback()
        except Exception as err:
            if not self._on_hook_error(err):
                raise

    def _finish_pass(self) -> None:
        """End of backward: launch what is left, wait for every bucket, copy averages into .grad."""
        deferred_layout = self.schedule.at_pass_end()
        if self._deferred or self._buckets is None:
            self._buckets = deferred_layout
        remaining = self._buckets[self._next_bucket:]  # parameters that got no gradient this pass, or held
        self._next_bucket = len(self._buckets)
        fingerprint = self._check.fingerprint
        if self._held and fingerprint is not None:
            flats = [self._flatten(bucket) for bucket in remaining]
            for flat, _ in flats:
                fingerprint.update(flat)
            self._check_local_gradient()  # before anything leaves
            for bucket, flat in zip(remaining, flats):
                self._launch_bucket(bucket, flat)
        else:
            for bucket in remaining:
                self._launch_bucket(bucket)
        used_everywhere = None
        if self.layout.find_unused_parameters:  # DDP's local_used_map, summed over the world
            local_used = torch.zeros(len(self.params), dtype=torch.int32, device=self.params[0].device)
            local_used[sorted(self._used)] = 1
            self._side.append(self.launch(local_used, average=False))
            used_everywhere = local_used  # summed in place
        self.wait()
        used = used_everywhere.tolist() if used_everywhere is not None and self.error is None else None
        for _, flat, work, in_place in self._pending:
            if in_place and work is not None and not work.is_completed():
                self._unsettled.append(work)  # abandoned: it may still write into the .grad tensors
        for bucket, flat, _, in_place in self._pending:
            if self.error is not None or in_place:
                continue
            offset = 0
            for j in bucket:
                p = self.params[j]
                n = p.numel()
                if used is not None and not used[j]:
                    pass  # no rank used it: its .grad is left as it is (DDP)
                elif p.grad is not None:
                    p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                elif used is not None:  # another rank used it: the average, as DDP gives
                    p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
        self._used.clear()
        self._reset_pass()

    # ---------------------------------------------------------------- the engine
    def _begin_pass(self) -> None:
        if self._callback_queued:
            return
        self._callback_queued = True
        self.error = None
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._guarded(self._at_pass_start)

    def _end_of_backward(self) -> None:
        self._finish_pass()
        if self.error is not None:
            error, self.error = self.error, None
            self._on_failure(f"gradient all-reduce failed: {error}")

    def launch(self, flat: torch.Tensor, average: bool = True) -> Any:
        """Divide ``flat`` by the world size (unless not ``average``) and start its all-reduce, in
        place; returns its ``Work`` for :meth:`wait`, or None when nothing was started (the pass
        already failed, or the group is broken: then :attr:`error` is set).

        No Python callback is attached to the work: one would run on the backend's thread and need
        the GIL while the training thread holds it (in backward, or recording the step), and a
        gloo rank's next bucket waits behind it. :meth:`wait` collects results and errors on the
        training thread instead."""
        self._start_collectives()
        if self.error is not None or self._is_failed():
            return None
        if average:
            flat.div_(self.world_size)
        try:
            return start_all_reduce(flat)
        except Exception as err:  # the group is already broken
            self.error = describe(err)
            return None

    def wait(self) -> None:
        """Wait for every all-reduce launched in this backward (the heartbeat probe sees the wait);
        the first failure is kept in :attr:`error`.

        ``Work.wait(timeout)`` releases the GIL and raises on timeout without touching the work
        (torch 2.13, gloo: "Operation timed out!", ``is_completed()`` still False), so the abort
        flag is looked at every :data:`ABANDON_POLL_S` s between waits; a failed all-reduce raises
        with ``is_completed()`` True. A work can complete between its timeout and that check, so
        a completed work is waited on once more, which returns or raises its own error
        (:func:`wait_out`)."""
        self._waiting.set()
        poll = timedelta(seconds=ABANDON_POLL_S)
        try:
            for work in [w for _, _, w, _ in self._pending] + self._side:
                if work is None:
                    continue
                outcome = "ended" if self._abandon is None else wait_out(work, self._abandon, poll)
                if outcome == "ended":
                    self._collect(work)
                elif outcome == "abandoned":
                    self.error = self.error or ABANDONED
                    return
        finally:
            self._waiting.clear()

    def _collect(self, work: Any) -> None:
        """The outcome of a completed ``work``: its failure, if any, is kept in :attr:`error`
        (recorded, never raised through autograd)."""
        try:
            work.wait()
        except Exception as err:
            self.error = self.error or describe(err)

    @property
    def unsettled(self) -> bool:
        """Whether an earlier pass gave up on an in-place all-reduce that had not finished."""
        return bool(self._unsettled)

    def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the all-reduces an earlier pass abandoned while
        they reduced ``.grad`` in place (an abort; the group's connections are cut by then, which
        fails them within milliseconds). True once none is in flight; False if one still is: it
        may yet write into the gradient tensors (DDP's bucket views, which every later backward
        reuses), so this process must not compute another gradient (:meth:`ftrun.rank.gradsync.GradientSync.settle`)."""
        deadline = time.monotonic() + timeout_s
        while self._unsettled and not all(work.is_completed() for work in self._unsettled):
            if time.monotonic() >= deadline:
                return False
            time.sleep(ABANDON_POLL_S)
        self._unsettled.clear()
        return True

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (DDP's ``no_sync``); the next synced backward averages them."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous


def start_all_reduce(tensor: torch.Tensor) -> Any:
    """Start a summing all-reduce of ``tensor``, in place, on the default group; returns its
    ``Work``. What ``dist.all_reduce(tensor, async_op=True)`` does for a dense tensor outside a
    coalescing context, without that function's Python wrapper (its logging decorators, checks and
    options object cost a rank about as much CPU as the collective's own launch: a
    bucket a backward). Anything else (a complex or sparse tensor, no default group, a coalescing
    context, a torch function mode) takes ``dist.all_reduce`` itself.

    Raises:
        RuntimeError: the backend failed to start it (a broken group)."""
    group = dist.group.WORLD
    if (group is None or tensor.is_complex() or tensor.layout != torch.strided or torch.overrides.has_torch_function((tensor,))
            or group in dist.distributed_c10d._world.pg_coalesce_state):
        return dist.all_reduce(tensor, async_op=True)
    return group.allreduce([tensor], _ASYNC_SUM)


_ASYNC_SUM = dist.AllreduceOptions()
_ASYNC_SUM.reduceOp = dist.ReduceOp.SUM
_ASYNC_SUM.asyncOp = True


# ---------------------------------------------------------------------------- without hooks
def all_reduce_in_buckets(grads: Sequence[torch.Tensor], world_size: int, cap: int = BUCKET_CAP_BYTES) -> None:
    """Average ``grads`` over the world in place (``Worker.all_reduce_gradients``: a model not given
    to ``wrap_model``): flattened in order into buckets of up to ``cap`` bytes (one dtype each),
    divided by ``world_size`` and summed, as DDP does; the layout depends only on the model, so
    every generation reduces in the same order and results stay bitwise reproducible.

    Raises:
        RuntimeError: (gloo's or NCCL's) an all-reduce failed.
    """
    for bucket in _buckets(grads, cap):
        flat = torch.cat([g.reshape(-1) for g in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1).clone()
        flat.div_(world_size)
        dist.all_reduce(flat)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _buckets(tensors: Sequence[torch.Tensor], cap: int) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > cap or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def broadcast_module(model: torch.nn.Module, src: int = 0) -> None:
    """Broadcast ``src``'s parameters and buffers over the default group (the initial broadcast).

    Raises:
        RuntimeError: the broadcast failed (a peer died).
    """
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=src)


BROADCAST_BUCKET_BYTES = 250 * _MIB  # DDP's broadcast_bucket_size


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Broadcast ``src``'s buffers of ``module`` over the default group, coalesced as DDP does
    before a forward (``_sync_buffers``).

    Raises:
        RuntimeError: the broadcast failed (a peer died).
    """
    buffers = list(module.buffers())
    if buffers:
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            dist._broadcast_coalesced(dist.group.WORLD, buffers, BROADCAST_BUCKET_BYTES, src)


def one_rank_group(device: torch.device, timeout_s: float) -> Any:
    """A process group of this rank alone, independent of ftrun's generations (DDP's group under
    ``wrap_model(ddp=True)``)."""
    from datetime import timedelta

    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    if device.type == "cuda":
        kind = dist.ProcessGroup.BackendType.NCCL
        backend = dist.ProcessGroupNCCL(store, 0, 1)
    else:
        kind = dist.ProcessGroup.BackendType.GLOO
        backend = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=timeout_s))
    group._set_default_backend(kind)
    group._register_backend(device, kind, backend)
    return group


def local_gradients_hook(_state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """DDP comm hook that communicates nothing: its bucket views are the ``.grad`` tensors that
    ftrun's reducer averages in place."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
