"""TTP (MindSpore's name): the training state kept when it cannot be repaired in place.

Before a whole-job restart, a failure with the budget used up, a lost node, or a stop by
SIGTERM/SIGINT, one live replica of each shard writes the newest step every shard committed (a
*dying-gasp* checkpoint); periodic checkpoints (``--save_steps``) are completed with their
manifest once every shard is in; every attempt starts from the newest complete checkpoint
(``--resume``). The files' format and checks are :mod:`ftrun.common.checkpoint`'s.
"""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ftrun.common import checkpoint as ckpt
from ftrun.common.events import EventKind
from ftrun.coordinator.policy import NoLiveReplica, plan_recovery
from ftrun.common.protocol import Message, MsgType
from ftrun.coordinator.phases import JobPhase

if TYPE_CHECKING:
    from ftrun.coordinator.core import Coordinator

log = logging.getLogger("ftrun.coordinator")

TTP_REPORT_WAIT_S = 10.0  # how long live ranks get to reach a safe point and report (dying gasp)
TTP_WRITE_WAIT_S = 300.0  # how long the shard writers get to write (dying gasp)


@dataclass
class DyingGasp:
    """A dying gasp in progress: its generation, the live ranks' reports, the writers and their files."""

    generation: int
    reports: dict[int, int] = field(default_factory=dict)  # rank -> committed step
    step: int | None = None  # the step being written
    writers: dict[int, int] = field(default_factory=dict)  # shard -> rank
    saved: dict[int, Message] = field(default_factory=dict)  # shard -> its SAVED report
    failed: str | None = None  # a writer's error


def job_command(spec: Any) -> dict[str, Any]:
    """The command a job's checkpoints are written by, kept in each manifest's ``extra``: the
    script (or module, or program) as given and its arguments."""
    return {"script": str(spec.script), "module": bool(spec.module), "args": [str(a) for a in spec.script_args]}


def program(command: Mapping[str, Any]) -> tuple[bool, str]:
    """What a recorded command runs: a module's name, or a script's file name (the same script
    given by another path, from another directory, is the same program)."""
    script = str(command.get("script", ""))
    return (True, script) if command.get("module") else (False, os.path.basename(script))


def command_line(command: Mapping[str, Any]) -> str:
    """A recorded command as one line (``-m module args`` or ``script args``)."""
    head = ["-m", str(command.get("script", ""))] if command.get("module") else [str(command.get("script", ""))]
    return shlex.join(head + [str(a) for a in command.get("args") or []])


class Checkpoints:
    """The job's checkpoints: which one an attempt starts from, periodic ones, dying gasps.

    Args:
        job: the coordinator (its spec, rank table, events, control plane and message pump).
    """

    def __init__(self, job: "Coordinator") -> None:
        self.job = job
        self.root = Path(job.spec.checkpoint_dir).resolve()
        self.resume_from: ckpt.Manifest | None = None  # the checkpoint this attempt starts from
        self.pending_saves: dict[int, dict[int, Message]] = {}  # step -> shard -> its SAVED report
        self.gasp: DyingGasp | None = None
        self.report_wait = TTP_REPORT_WAIT_S  # seconds (real time) live ranks get to report for a dying gasp
        self.written = 0  # periodic checkpoints completed
        self.failed: dict[int, str] = {}  # step -> why a periodic checkpoint of it failed (its first writer's error)
        self.newest: tuple[int, Path] | None = None  # (step, directory): the newest this attempt completed or started from

    def choose(self, attempt: int) -> ckpt.Manifest | None:
        """The checkpoint attempt ``attempt`` starts from: ``--resume`` for the first (``auto``:
        the newest complete one, when TTP is on), the newest complete one for a whole-job restart.
        Each checkpoint skipped (no manifest, a size or checksum mismatch) is a warning event."""
        spec, job = self.job.spec, self.job

        def skipped(path: Path, reason: str) -> None:
            job.emit(EventKind.WARNING, f"skipping checkpoint {path}: {reason}", path=str(path), reason=reason)

        choice = spec.resume
        if choice == "auto" and not spec.tft.ttp:
            choice = "none"
        manifest = None
        try:
            if attempt > 0 and choice != "none":
                manifest = ckpt.find_latest(self.root, skipped) or self.resume_from
            else:
                manifest = ckpt.resolve_resume(self.root, choice, skipped)
        except ckpt.CheckpointError as err:  # checked by the launcher; it may have changed since
            skipped(err.path, err.problem)
        if manifest is not None and manifest.world_size != spec.worker_num and not manifest.sliced:
            # A sliced checkpoint (a sharded model's, in DCP's format: ftrun.rank.dcp) reshards onto any world size.
            skipped(manifest.directory, f"written by {manifest.world_size} ranks, this job has {spec.worker_num}")
            manifest = None
        # Another program's checkpoint is not resumed unasked: at the first attempt under 'auto', and
        # at a whole-job restart unless it is the one the first attempt started from.
        if manifest is not None and (choice == "auto" if attempt == 0 else
                                     self.resume_from is None or manifest.directory != self.resume_from.directory):
            manifest = self._own(manifest, skipped) or (self.resume_from if attempt > 0 else None)
        if manifest is not None:
            job.emit(EventKind.RESUMED,
                     f"starting from checkpoint {manifest.directory} (step {manifest.step}; training resumes at step {manifest.step + 1})",
                     path=str(manifest.directory), step=manifest.step)
        self.resume_from = manifest
        self.newest = (manifest.step, manifest.directory) if manifest is not None else None
        self.pending_saves.clear()
        return manifest

    def rollback_target(self) -> tuple[int, Path] | None:
        """(step, directory) of the checkpoint every rank may roll back to in place when no replica
        holds a lost rank's state (:func:`ftrun.coordinator.policy.plan_rollback`): the newest one this attempt
        completed or started from, if its files are all there with their sizes and no rank found
        it unusable. Each rank checks its own files' checksums as it loads them. None: there is
        none (a warning event says why when one was found wanting)."""
        if self.newest is None:
            return None
        step, directory = self.newest
        try:
            ckpt.verify(directory, checksums=False)
            unusable = ckpt.read_unusable_note(directory)
            if unusable is not None:
                raise ckpt.CheckpointError(unusable[0], unusable[1])
        except ckpt.CheckpointError as err:
            self.job.emit(EventKind.WARNING, f"checkpoint {directory} cannot be rolled back to: {err}", path=str(directory))
            self.newest = None
            return None
        return step, directory

    def _own(self, manifest: ckpt.Manifest, skipped: ckpt.OnSkip) -> ckpt.Manifest | None:
        """``manifest`` if ``--resume auto`` may start from it: a checkpoint another program wrote
        (the command its manifest names runs another script or module) is skipped, and one this
        program wrote with other arguments is used with a warning naming them (a longer run
        resumed is what a user rerunning with more epochs means; a checkpoint past the end of a
        shorter run is not, and the warning says why its loop then runs no step). A manifest that
        names no command (written by an older ftrun, or by the ranks after the supervisor died)
        is used as before."""
        recorded, ours = self._command_of(manifest), job_command(self.job.spec)
        if recorded is None:
            return manifest
        theirs = command_line(recorded)
        if self._another_program(manifest):
            skipped(manifest.directory, f"written by another program ({theirs}) than this job's ({command_line(ours)}); "
                                        f"give --resume {manifest.directory} to start from it anyway")
            return None
        if list(recorded.get("args") or []) != ours["args"]:
            self.job.emit(EventKind.WARNING,
                          f"checkpoint {manifest.directory} (step {manifest.step}) was written by `{theirs}`, this job runs "
                          f"`{command_line(ours)}`: resuming from it all the same (--resume none starts afresh)",
                          path=str(manifest.directory), command=theirs)
        return manifest

    @staticmethod
    def _command_of(manifest: ckpt.Manifest) -> dict[str, Any] | None:
        """The command ``manifest`` names (:func:`job_command`), or None where it names none."""
        recorded = manifest.extra.get("command")
        return recorded if isinstance(recorded, dict) else None

    def _another_program(self, manifest: ckpt.Manifest) -> bool:
        """Whether ``manifest`` names a command that runs another program than this job's."""
        recorded = self._command_of(manifest)
        return recorded is not None and program(recorded) != program(job_command(self.job.spec))

    def unusable(self) -> tuple[Path, str] | None:
        """(file, problem) when a rank found that the checkpoint this attempt started from does not
        load (:func:`ftrun.common.checkpoint.mark_unusable`): the attempt's failure is the checkpoint's."""
        return ckpt.read_unusable_note(self.resume_from.directory) if self.resume_from is not None else None

    def on_saved(self, msg: Message) -> None:
        """A shard file was written (dying gasp or periodic checkpoint)."""
        if self.gasp is not None and msg["step"] == self.gasp.step:
            self.gasp.saved[msg["shard"]] = msg
        elif msg["reason"] == "periodic":
            self.on_periodic_save(msg)

    def on_writer_error(self, rank: int, reason: str) -> None:
        """A rank reports a shard it could not write: a dying gasp waiting for it stops waiting."""
        if self.gasp is not None and rank in self.gasp.writers.values():
            self.gasp.failed = f"rank {rank}: {reason}"

    def on_periodic_failure(self, rank: int, step: int, reason: str) -> None:
        """A writer could not write its shard of ``step``'s periodic checkpoint: that checkpoint
        will not complete; counted, and said with the count so far (a full disk fails them all)."""
        self.pending_saves.pop(step, None)
        if step in self.failed:
            return
        self.failed[step] = reason
        self.job.emit(EventKind.WARNING, f"rank {rank}: {reason} ({self.failures()})", rank=rank,
                      fault="checkpoint_failed", step=step, reason=reason, failed=len(self.failed),
                      attempted=len(self.failed) + self.written)

    def failures(self) -> str:
        """``"3 of 4 periodic checkpoints failed"`` (empty when none failed)."""
        if not self.failed:
            return ""
        return f"{len(self.failed)} of {len(self.failed) + self.written} periodic checkpoints failed"

    def status(self) -> dict[str, Any]:
        """The checkpoints' part of the job's status (``ftrun status``)."""
        last = self.failed[max(self.failed)] if self.failed else None
        return {"checkpoints": {"written": self.written, "failed": len(self.failed), "last_error": last}}

    def on_periodic_save(self, msg: Message) -> None:
        """A shard of a periodic checkpoint is written; once every shard is, write the manifest."""
        try:
            groups = self.job.rounds.replica_groups()
        except ValueError:
            return
        saves = self.pending_saves.setdefault(msg["step"], {})
        saves[msg["shard"]] = msg
        if len(saves) < len(groups):
            return
        del self.pending_saves[msg["step"]]
        for old in [s for s in self.pending_saves if s < msg["step"]]:
            del self.pending_saves[old]  # a shard of it never came: that checkpoint stays incomplete
        self.complete(msg["step"], groups, saves, "periodic")

    def complete(self, step: int, groups: list[list[int]], saves: dict[int, Message], reason: str) -> None:
        """Write the manifest of ``step``'s checkpoint (its shards are in) and prune old ones."""
        spec, job = self.job.spec, self.job
        directory = ckpt.step_dir(self.root, step)
        try:
            ckpt.write_manifest(
                directory, step, spec.worker_num, groups, {k: m["info"] for k, m in saves.items()},
                reason=reason, torch_version=next(iter(saves.values()))["torch_version"],
                extra={"command": job_command(spec)},
            )
            removed = ckpt.prune(self.root, spec.keep_checkpoints) if spec.keep_checkpoints else []
        except (OSError, ckpt.CheckpointError) as err:
            job.emit(EventKind.WARNING, f"checkpoint of step {step} not completed: {err}", step=step)
            return
        if reason == "periodic":
            self.written += 1
        if self.newest is None or step >= self.newest[0]:
            self.newest = (step, directory)
        nbytes = sum(int(f["bytes"]) for m in saves.values() for f in [m["info"], *m["info"].get("dcp", ())])
        seconds = max(float(m["seconds"]) for m in saves.values())
        job.emit(EventKind.CHECKPOINT_SAVED,
                 f"checkpoint of step {step} written ({reason}): {nbytes / 1e6:.2f} MB in {seconds:.2f} s, {directory}",
                 step=step, bytes=nbytes, seconds=round(seconds, 3), path=str(directory), reason=reason,
                 pruned=[str(p) for p in removed])

    def resume_hint(self) -> str:
        """'; newest checkpoint: ...' for a failure summary, or '' when there is none."""
        if not self.job.spec.tft.ttp:
            return ""
        newest = ckpt.find_latest(self.root, on_skip=lambda *_: None, checksums=False)
        if newest is None or self._another_program(newest):
            return ""  # none, or another program's: the same command would not resume from it
        return f"; newest checkpoint: step {newest.step} in {newest.directory} (the same command resumes from it)"

    def dying_gasp(self, reason: str) -> None:
        """Have one live replica of each shard write the newest step every shard committed.

        Live ranks are aborted (a new generation) so that each stops at a safe point (its group
        down, its state exactly its committed step) and reports that step; the step S is chosen as
        for a recovery; the lowest-ranked replica holding S writes each shard; the manifest is
        written once every shard is in. A shard without a live replica holding S means no
        checkpoint at all (never a partial one), said in an event. The job is in phase
        ``gasping`` meanwhile (when there is anyone to ask).
        """
        job = self.job
        live = [r for r in job.ranks.values() if r.connected() and r.library]
        if not job.spec.tft.ttp or not live:
            return
        started = job.clock()
        job.rounds.current = None
        job.state.next_generation()
        job.phase.move(JobPhase.GASPING)
        gasp = self.gasp = DyingGasp(job.generation)
        try:
            for r in live:
                job.send(r, MsgType.ABORT, generation=gasp.generation, reason=f"saving a dying-gasp checkpoint: {reason}")
            job.pump(lambda: set(gasp.reports) >= {r.rank for r in live if r.alive()}, self.report_wait)
            reports = {rank: c for rank, c in gasp.reports.items() if job.ranks[rank].alive()}
            try:
                groups = job.rounds.replica_groups()
                plan = plan_recovery(reports, groups)
            except (NoLiveReplica, ValueError) as err:
                job.emit(EventKind.WARNING, f"TTP: no dying-gasp checkpoint, nothing written: {err}", reason=str(err))
                return
            step = plan.step
            if step < 0:
                return  # nothing committed yet: nothing to keep
            newest = ckpt.find_latest(self.root, on_skip=lambda *_: None, checksums=False)
            if newest is not None and newest.step >= step:
                job.emit(EventKind.WARNING, f"TTP: step {step} is already in checkpoint {newest.directory}; nothing to write")
                return
            groups = ckpt.canonical_groups(groups)
            gasp.writers = {k: min(r for r in g if reports.get(r) == step) for k, g in enumerate(groups)}
            gasp.step = step
            directory = ckpt.step_dir(self.root, step)
            for shard, rank in gasp.writers.items():
                job.send(job.ranks[rank], MsgType.SAVE, generation=gasp.generation, step=step, shard=shard,
                         directory=str(directory), reason="dying gasp")
            job.pump(lambda: len(gasp.saved) == len(gasp.writers) or gasp.failed is not None
                     or not all(job.ranks[w].alive() for w in gasp.writers.values()), TTP_WRITE_WAIT_S)
            if len(gasp.saved) < len(gasp.writers):
                missing = sorted(set(gasp.writers) - set(gasp.saved))
                why = gasp.failed or f"shard(s) {missing} not written"
                job.emit(EventKind.WARNING, f"TTP: dying-gasp checkpoint of step {step} incomplete ({why}); not completed")
                return
            self.complete(step, groups, gasp.saved, f"dying gasp ({reason})")
            log.info("dying gasp took %.2f s", job.clock() - started)
        finally:
            self.gasp = None
