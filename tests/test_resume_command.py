"""``--resume auto`` starts from this program's own checkpoints (a job run in a
directory that holds another run's ``ftrun_checkpoints`` does not resume from it). Each manifest the
coordinator writes names the command that wrote it; a checkpoint of another script is skipped
with a warning that says how to use it anyway, one of the same script with other arguments is
used with a warning naming them, one that names no command (an older ftrun's) is used as before.
Pure logic: a real checkpoint on disk, the coordinator's checkpoint keeper with a stand-in job."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ftrun.common import checkpoint as ckpt
from ftrun.config.options import JobSpec
from ftrun.coordinator.ttp import Checkpoints, job_command


class Job:
    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.events: list[tuple[str, str]] = []

    def emit(self, kind: Any, message: str, **_fields: Any) -> None:
        self.events.append((str(kind.value if hasattr(kind, "value") else kind), message))


def _write(root: Path, step: int, command: dict[str, Any] | None) -> Path:
    directory = ckpt.step_dir(root, step)
    directory.mkdir(parents=True)
    data = b"shard bytes"
    (directory / "shard_0.pt").write_bytes(data)
    info = ckpt.ShardInfo("shard_0.pt", len(data), hashlib.sha256(data).hexdigest())
    ckpt.write_manifest(directory, step, 2, [[0, 1]], {0: info}, reason="periodic",
                        extra={"command": command} if command is not None else None, torch_version="x")
    return directory


def _keeper(tmp_path: Path, script: str, args: tuple[str, ...] = (), resume: str = "auto",
            module: bool = False) -> tuple[Checkpoints, Job]:
    spec = JobSpec(script=script, script_args=args, module=module, worker_num=2, local_worker_num=2,
                   log_dir=str(tmp_path), checkpoint_dir=str(tmp_path / "ckpt"), master_port=29500, resume=resume)
    job = Job(spec)
    return Checkpoints(job), job  # type: ignore[arg-type]


def test_the_same_command_resumes_quietly(tmp_path: Path) -> None:
    keeper, job = _keeper(tmp_path, "/somewhere/train.py", ("--epochs", "6"))
    written = _write(tmp_path / "ckpt", 40, job_command(job.spec))
    assert json.loads((written / "manifest.json").read_text())["extra"]["command"] == {
        "script": "/somewhere/train.py", "module": False, "args": ["--epochs", "6"]}
    manifest = keeper.choose(0)
    assert manifest is not None and manifest.step == 40
    assert [kind for kind, _ in job.events] == ["resumed"], job.events


def test_another_script_s_checkpoint_is_not_resumed(tmp_path: Path) -> None:
    written = _write(tmp_path / "ckpt", 40, {"script": "other.py", "module": False, "args": []})
    keeper, job = _keeper(tmp_path, "train.py")
    assert keeper.choose(0) is None
    (kind, message), = job.events
    assert kind == "warning"
    assert f"skipping checkpoint {written}: written by another program (other.py) than this job's (train.py)" in message
    assert f"give --resume {written} to start from it anyway" in message


def test_the_same_script_with_other_arguments_resumes_and_says_so(tmp_path: Path) -> None:
    _write(tmp_path / "ckpt", 40, {"script": "./train.py", "module": False, "args": ["--epochs", "20"]})
    keeper, job = _keeper(tmp_path, "/abs/train.py", ("--epochs", "6"))
    manifest = keeper.choose(0)
    assert manifest is not None and manifest.step == 40
    kinds = [kind for kind, _ in job.events]
    assert kinds == ["warning", "resumed"], job.events
    assert "was written by `./train.py --epochs 20`, this job runs `/abs/train.py --epochs 6`" in job.events[0][1]
    assert "--resume none starts afresh" in job.events[0][1]


def test_a_module_is_not_a_script_of_the_same_name(tmp_path: Path) -> None:
    _write(tmp_path / "ckpt", 40, {"script": "train", "module": True, "args": []})
    keeper, _ = _keeper(tmp_path, "train")
    assert keeper.choose(0) is None
    keeper, _ = _keeper(tmp_path, "train", module=True)
    assert keeper.choose(0) is not None


def test_a_manifest_without_a_command_resumes_as_before(tmp_path: Path) -> None:
    _write(tmp_path / "ckpt", 40, None)
    keeper, job = _keeper(tmp_path, "train.py")
    assert keeper.choose(0) is not None
    assert [kind for kind, _ in job.events] == ["resumed"], job.events


def test_an_explicit_path_is_not_checked_and_a_restart_keeps_to_it(tmp_path: Path) -> None:
    written = _write(tmp_path / "ckpt", 40, {"script": "other.py", "module": False, "args": []})
    keeper, job = _keeper(tmp_path, "train.py", resume=str(written))
    assert keeper.choose(0).directory == written  # the user named it
    assert keeper.choose(1).directory == written  # a whole-job restart: the newest is still the one named
    assert [kind for kind, _ in job.events] == ["resumed", "resumed"], job.events


def test_a_whole_job_restart_does_not_take_another_program_s_checkpoint_either(tmp_path: Path) -> None:
    _write(tmp_path / "ckpt", 40, {"script": "other.py", "module": False, "args": []})
    keeper, job = _keeper(tmp_path, "train.py")
    assert keeper.choose(0) is None
    assert keeper.choose(1) is None  # seen: the first attempt failed and its restart resumed the other's
    assert keeper.resume_hint() == ""  # the failure summary does not offer it either
    own = _write(tmp_path / "ckpt", 50, job_command(job.spec))  # a dying gasp of this job
    assert keeper.choose(2).directory == own
    assert keeper.resume_hint() == f"; newest checkpoint: step 50 in {own} (the same command resumes from it)"
