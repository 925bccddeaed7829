#!/usr/bin/env bash
# ftrun's GPU check: one command, run from the repository root on a machine with a CUDA GPU (a lent
# one: see docs/gpu.md). It installs the wheels carried in device_wheels/ (scripts/device_wheels.sh),
# runs the GPU tests (tests/test_gpu.py, marker gpu) and the job checks and measurements
# (scripts/gpu_check.py), and writes under $OUT (else ./gpu_check_out):
#   gpu_check.log        everything printed
#   gpu_check.json       each stage's and each check's status, and every figure measured
#   gpu_check_jobs.json  the job checks' own record;  gpu_tests.xml  the GPU tests' junit report
#   figures.jsonl        what the GPU tests measured;  job_logs.tar.gz  the jobs' logs (on a failure)
# It ends in under 8 minutes (each stage has its own limit). Exit code: 0 when every stage passed on
# a GPU; 1 when one failed (torch seeing no GPU is a failure); 3 for a dry run (nothing checked on a GPU).
#
# With the device tool (from this repository's root, here):
#   bash scripts/device_wheels.sh                      # once: pyzmq and pytest-rerunfailures, ~1 MiB
#   run(command="bash scripts/gpu_check.sh", carry=["device_wheels"], timeout_s=540)
#
# FTRUN_GPU_CHECK_DRY=1 rehearses it where there is no GPU: the same stages, the wheels installed
# for Python 3.12 into a scratch folder (not used), the GPU tests expected to skip, the job checks run
# on the CPU with gloo (scripts/gpu_check.py --device cpu; FTRUN_GPU_CHECK_ONLY=name,name picks some).
# A rehearsal checks the script's own logic, nothing about CUDA, and says so: its exit code is 3.
# On a busy CPU give it time: FTRUN_GPU_CHECK_JOBS_LIMIT_S (the job stage, default 300) and
# FTRUN_GPU_CHECK_JOB_TIMEOUT_S (one job, default 120).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/gpu_check.log
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
PYTHON=${PYTHON:-python3}
DRY=${FTRUN_GPU_CHECK_DRY:-0}
ONLY=${FTRUN_GPU_CHECK_ONLY:-}
JOBS_LIMIT_S=${FTRUN_GPU_CHECK_JOBS_LIMIT_S:-300}  # the job checks' stage (raise it only for a rehearsal on a busy CPU)
STAGES=$OUT_DIR/.stages.tsv
: >"$STAGES"
rm -f "$OUT_DIR/figures.jsonl" "$OUT_DIR/gpu_check_jobs.json" "$OUT_DIR/gpu_tests.xml"
export PYTHONUNBUFFERED=1
START=$(date +%s)

# stage NAME STATUS DETAIL: one line on the console, one row for the JSON.
stage() {
    local detail
    detail=$(printf '%s' "$3" | tr '\t\n' '  ')
    printf '%-9s %s: %s\n' "$2" "$1" "$detail"
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$(( $(date +%s) - START ))" "$detail" >>"$STAGES"
}

echo "gpu_check: $(date -u +%FT%TZ) on $(hostname), dry=$DRY, out=$OUT_DIR"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# 1. The carried wheels (the lent machine has no package registry).
SITE=$(mktemp -d /tmp/ftrun_site.XXXXXX)
WHEELS=$(ls device_wheels/*.whl 2>/dev/null | tr '\n' ' ')
if [ -z "$WHEELS" ]; then
    if "$PYTHON" -c "import zmq" 2>/dev/null; then
        stage wheels PASS "none carried; pyzmq already installed"
    else
        stage wheels FAIL "no device_wheels/*.whl and no pyzmq: run scripts/device_wheels.sh here and carry device_wheels"
    fi
elif [ "$DRY" = 1 ]; then
    # Install them as the lent machine would, for its Python (3.12), into a folder left unused here.
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux2014_x86_64 --platform any $WHEELS; then
        stage wheels PASS "$(echo $WHEELS | wc -w) wheel(s) install for CPython 3.12 (dry: not used)"
    else
        stage wheels FAIL "pip could not install $WHEELS"
    fi
elif "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" $WHEELS; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    stage wheels PASS "$(echo $WHEELS | wc -w) wheel(s) installed into $SITE"
else
    stage wheels FAIL "pip could not install $WHEELS"
fi
# ftrun itself from this tree (no install: the lent machine cannot fetch a build backend).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# 2. Imports and the GPU.
if INFO=$("$PYTHON" -c "import ftrun.rank.worker, ftrun.rank.cuda, zmq, msgpack, xxhash, torch; print(torch.__version__, int(torch.cuda.is_available()), torch.cuda.device_count())" 2>&1); then
    stage imports PASS "torch $INFO"
    GPU=$(echo "$INFO" | awk '{print $2}')
else
    stage imports FAIL "$(echo "$INFO" | tail -3 | tr '\n' ' ')"
    GPU=0
fi
if [ "$GPU" != 1 ] && [ "$DRY" != 1 ]; then
    stage gpu FAIL "torch sees no CUDA GPU: nothing checked (FTRUN_GPU_CHECK_DRY=1 rehearses the logic)"
fi

# 3. The GPU tests (and the CUDA path's logic tests beside them).
if [ "$GPU" = 1 ] || [ "$DRY" = 1 ]; then
    FTRUN_GPU_FIGURES="$OUT_DIR/figures.jsonl" timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
        --junitxml="$OUT_DIR/gpu_tests.xml" tests/test_gpu.py tests/test_cuda_path.py
    rc=$?
    COUNTS=$("$PYTHON" - "$OUT_DIR/gpu_tests.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception:
    print("0 0 0 0"); sys.exit()
suite = root if root.tag == "testsuite" else root.find("testsuite")
gpu = [c for c in suite.iter("testcase") if c.get("classname", "").endswith("test_gpu")]
skipped = sum(1 for c in gpu if c.find("skipped") is not None)
print(int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0)), len(gpu), skipped)
EOF
)
    read -r total failed gpu_tests gpu_skipped <<<"$COUNTS"
    detail="pytest rc=$rc: $total test(s), $failed failed; $gpu_tests GPU test(s), $gpu_skipped skipped"
    if [ "$rc" = 124 ]; then
        stage gpu_tests FAIL "timed out after 150 s; $detail"
    elif [ "$GPU" = 1 ]; then
        if [ "$rc" = 0 ] && [ "$gpu_tests" -gt 0 ] && [ "$gpu_skipped" = 0 ]; then
            stage gpu_tests PASS "$detail"
        else
            stage gpu_tests FAIL "$detail"
        fi
    elif [ "$rc" = 0 ] && [ "$gpu_tests" -gt 0 ] && [ "$gpu_skipped" = "$gpu_tests" ]; then
        stage gpu_tests REHEARSED "$detail (no GPU: every GPU test skipped, as it must)"
    else
        stage gpu_tests FAIL "$detail"
    fi

# 4. The job checks and measurements.
    DEVICE=cuda
    [ "$GPU" = 1 ] || DEVICE=cpu
    timeout "$JOBS_LIMIT_S" "$PYTHON" scripts/gpu_check.py --device "$DEVICE" --out "$OUT_DIR" ${ONLY:+--only "$ONLY"}
    rc=$?
    case "$rc" in
        0) stage jobs PASS "every job check passed on the GPU" ;;
        3) if [ "$DEVICE" = cpu ]; then stage jobs REHEARSED "job checks run on the CPU: nothing checked on a GPU"
           else stage jobs FAIL "gpu_check.py found no GPU"; fi ;;
        124) stage jobs FAIL "timed out after $JOBS_LIMIT_S s (gpu_check_jobs.json holds the checks done)" ;;
        *) stage jobs FAIL "gpu_check.py exited $rc (see its FAIL lines)" ;;
    esac
    if grep -q $'\tFAIL\t' "$STAGES"; then
        WORK=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['work_dir'])" "$OUT_DIR/gpu_check_jobs.json" 2>/dev/null)
        [ -n "$WORK" ] && [ -d "$WORK" ] && tar -czf "$OUT_DIR/job_logs.tar.gz" -C "$WORK" . 2>/dev/null
    fi
fi

# 5. One JSON of every stage, check and figure; the exit code.
"$PYTHON" - "$OUT_DIR" "$DRY" "$GPU" <<'EOF'
import json, sys
from pathlib import Path
out, dry, gpu = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
stages = [dict(zip(("name", "status", "at_s", "detail"), line.split("\t", 3)))
          for line in (out / ".stages.tsv").read_text().splitlines() if line.count("\t") >= 3]
jobs = out / "gpu_check_jobs.json"
figures = out / "figures.jsonl"
doc = {"gpu": gpu, "dry": dry, "stages": stages,
       "jobs": json.loads(jobs.read_text()) if jobs.exists() else None,
       "test_figures": [json.loads(l) for l in figures.read_text().splitlines() if l.strip()] if figures.exists() else []}
failed = [s["name"] for s in stages if s["status"] == "FAIL"]
doc["passed"] = gpu and not dry and not failed and all(s["status"] == "PASS" for s in stages)
(out / "gpu_check.json").write_text(json.dumps(doc, indent=1))
EOF
rm -f "$STAGES"
rm -rf "$SITE"
ELAPSED=$(( $(date +%s) - START ))
if grep -q '"passed": true' "$OUT_DIR/gpu_check.json" 2>/dev/null; then
    echo "gpu_check: PASS in ${ELAPSED} s ($OUT_DIR/gpu_check.json)"
    exit 0
fi
if [ ! -f "$OUT_DIR/gpu_check.json" ] || "$PYTHON" -c "import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if any(s['status']=='FAIL' for s in d['stages']) else 1)" "$OUT_DIR/gpu_check.json"; then
    echo "gpu_check: FAIL in ${ELAPSED} s ($OUT_DIR/gpu_check.json)"
    exit 1
fi
echo "gpu_check: nothing checked on a GPU (dry=$DRY, gpu=$GPU) in ${ELAPSED} s: not a pass"
exit 3
