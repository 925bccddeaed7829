"""The deployment examples of examples/deploy/, checked without a cluster: the Slurm batch script
(bash syntax, well-formed ``#SBATCH`` lines, and a dry run with stand-ins for ``srun``,
``scontrol`` and ``ftrun``) and the Kubeflow PyTorchJob manifest (parsed, its key fields)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "examples" / "deploy"
SBATCH = DEPLOY / "ftrun.sbatch"
MANIFEST = DEPLOY / "pytorchjob.yaml"

# sbatch options the script may use, long form (Slurm stops reading #SBATCH at the first command).
SBATCH_OPTIONS = {"job-name", "nodes", "ntasks-per-node", "cpus-per-task", "time", "no-kill", "output", "error",
                  "partition", "account", "gres", "gpus-per-node", "exclusive", "mem", "requeue", "signal", "open-mode"}


def test_sbatch_is_bash():
    bash = shutil.which("bash")
    assert bash, "bash is needed"
    result = subprocess.run([bash, "-n", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert SBATCH.read_text().startswith("#!/bin/bash\n")


def test_sbatch_directives_are_well_formed():
    lines = SBATCH.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#"))
    directives = [(i, line) for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert directives
    options = {}
    for i, line in directives:
        assert i < first_command, f"#SBATCH after the first command is ignored by Slurm: {line!r}"
        match = re.fullmatch(r"#SBATCH --([a-z][a-z-]*)(?:=(\S+))?", line)
        assert match, f"not '#SBATCH --option[=value]' (no trailing comment): {line!r}"
        assert match.group(1) in SBATCH_OPTIONS, f"unexpected sbatch option: {line!r}"
        options[match.group(1)] = match.group(2)
    assert not [line for line in lines if re.match(r"#\s+SBATCH|#sbatch", line)], "a misspelled directive"
    assert options["ntasks-per-node"] == "1"  # one ftrun per node: it starts the node's ranks
    assert int(options["nodes"]) >= 2


FAKES = {
    "scontrol": '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] || exit 9\nfor h in n01 n02 n03; do echo $h; done\n',
    # srun runs its command once per task, here one task: enough to see what each step would run.
    "srun": '#!/bin/bash\n{ echo "srun $*"; echo "token=$FTRUN_TOKEN nproc=$FTRUN_LOCAL_WORKER_NUM '
            'port=$FTRUN_MASTER_PORT ckpt=$FTRUN_CHECKPOINT_DIR"; } >> "$FAKE_LOG"\n'
            'while [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n',
    # Each ftrun lasts a second, so that the spare's loop starts while node 0 runs.
    "ftrun": '#!/bin/bash\necho "ftrun $*" >> "$FAKE_LOG"\nsleep 1\n',
}


def test_sbatch_dry_run(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FTRUN_", "PET_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_LOG=str(log), SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="3",
               SLURM_NNODES="3", SLURM_JOB_NODELIST="n[01-03]", SLURM_SUBMIT_DIR=str(tmp_path))
    result = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = log.read_text().splitlines()
    steps = [c for c in calls if c.startswith("srun ")]
    # One one-node step per host (the first two train, the last is the spare), the same command.
    for host in ("n01", "n02", "n03"):
        step = next(c for c in steps if f"--nodelist={host}" in c)
        assert "--nodes=1" in step and "--ntasks=1" in step, step
    ftrun_calls = [c for c in calls if c.startswith("ftrun ")]
    assert set(ftrun_calls) == {"ftrun --nnodes 2 examples/train_digits.py --steps 3000"}  # no index: decided at start
    tokens = {m.group(1) for c in calls for m in [re.match(r"token=(\S*) ", c)] if m}
    assert len(tokens) == 1 and re.fullmatch(r"[0-9a-f]{64}", tokens.pop())  # made once, the same everywhere
    assert any(f"port={20000 + 4242} ckpt={tmp_path}/ftrun_checkpoints/4242" in c for c in calls)


def test_sbatch_passes_its_arguments_as_the_training_command(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FTRUN_", "PET_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_LOG=str(log), SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="3",
               SLURM_NNODES="3", SLURM_JOB_NODELIST="n[01-03]", SLURM_SUBMIT_DIR=str(tmp_path))
    result = subprocess.run(["bash", str(SBATCH), "train.py", "--lr", "0.1 0.2"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ftrun --nnodes 2 train.py --lr 0.1 0.2" in log.read_text().splitlines()


def _job():
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    jobs = [d for d in docs if d.get("kind") == "PyTorchJob"]
    assert len(jobs) == 1
    return jobs[0]


def test_pytorchjob_manifest():
    job = _job()
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert isinstance(job["spec"]["nprocPerNode"], str)  # the operator's field is a string ("2", "auto")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"}
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] >= 1
    for role, replica in replicas.items():
        assert replica["restartPolicy"] == "OnFailure", role  # a failed pod comes back as the replacement
        containers = replica["template"]["spec"]["containers"]
        main = next(c for c in containers if c["name"] == "pytorch")  # the operator's container name
        command = main["command"]
        assert command[:2] == ["ftrun", "examples/train_digits.py"], role
        assert not any(a.startswith(("--node_rank", "--node-rank", "--nnodes", "--master")) for a in command)
        env = {e["name"]: e for e in main["env"]}
        ref = env["FTRUN_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] and ref["key"] and "value" not in env["FTRUN_TOKEN"]  # from a Secret, never inline
        assert any(p["name"] == "pytorchjob-port" for p in main["ports"])  # becomes PET_MASTER_PORT
        assert env["FTRUN_CHECKPOINT_DIR"]["value"].startswith(
            tuple(m["mountPath"] for m in main["volumeMounts"]))  # checkpoints on the shared volume
