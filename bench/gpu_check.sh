#!/usr/bin/env bash
# GPU check for a CUDA machine: one prepared script, bounded in time, that keeps going when a step fails.
#
#   bash bench/gpu_check.sh [OUT_DIR]        # OUT_DIR: $1, else $OUT, else ./gpu-check
#
# Steps (each under its own time limit; output to the terminal and to OUT_DIR/logs/<step>.log):
#   1. nvidia-smi   GPU name, driver, memory
#   2. torch-cuda   torch / CUDA / cuDNN versions, the device, bf16 support and one bf16 matmul figure
#                   (OUT_DIR/torch_cuda.json); fails when torch sees no CUDA device
#   3. swarm        python -m node swarm --nodes 3 --stages 2 --steps 20 --device cuda --report OUT_DIR/swarm
#   4. micro        python -m bench.compute.micro --device cuda --out OUT_DIR/micro.json (codec / filter / PowerSGD
#                   micro-benchmarks); reported as absent, not failed, when bench/compute/micro.py is not there
# OUT_DIR/gpu_check.txt collects versions, the GPU, and each step's exit code and duration. It is written
# as the steps finish, so a run cut short by the time limit still leaves what it had.
#
# Environment: PYTHON (default: .venv/bin/python if present, else python3); GPU_CHECK_TIMEOUT (the whole
# script, default 570 s); GPU_CHECK_SWARM_TIMEOUT (270 s); GPU_CHECK_MICRO_TIMEOUT (150 s).
# Exit status: 0 when every step that ran passed, 1 when one failed, 124 when the whole run timed out.
set -euo pipefail
# Job control: every background job gets its own process group, and signals reach it normally.
set -m

OUT_DIR="${1:-${OUT:-./gpu-check}}"
mkdir -p "$OUT_DIR/logs"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SUMMARY="$OUT_DIR/gpu_check.txt"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The whole script runs under `timeout`: this outer invocation runs the same file again as the inner one,
# forwards Ctrl-C / SIGTERM to it, and notes a timeout in the summary.
if [[ -z "${GPU_CHECK_INNER:-}" ]]; then
    limit="${GPU_CHECK_TIMEOUT:-570}"
    GPU_CHECK_INNER=1 timeout --kill-after=30 "$limit" bash "${BASH_SOURCE[0]}" "$OUT_DIR" &
    child=$!
    trap 'kill -TERM "$child" 2>/dev/null || true' INT TERM HUP
    rc=0
    wait "$child" || rc=$?
    while kill -0 "$child" 2>/dev/null; do # a signal interrupted `wait`: wait for the inner run to end
        rc=0
        wait "$child" || rc=$?
    done
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        echo "overall: TIMED OUT or interrupted (exit $rc, limit ${limit} s); the lines above are what finished" \
            >>"$SUMMARY"
        echo "gpu_check: timed out or interrupted; partial summary in $SUMMARY" >&2
    fi
    exit "$rc"
fi

cd "$REPO_ROOT"
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
else
    PY=python3
fi
export PYTHONUNBUFFERED=1

: >"$SUMMARY"
record() { printf '%s: %s\n' "$1" "$2" >>"$SUMMARY"; }

FAILED=()
STEP_PID=""
STEP_NAME=""

# On SIGTERM (the outer timeout) or Ctrl-C: stop the running step's process group (its `timeout` passes
# SIGTERM on to the command, e.g. the swarm, which stops its nodes cleanly), note it, and exit.
on_signal() {
    if [[ -n "$STEP_PID" ]]; then
        kill -TERM -- "-$STEP_PID" 2>/dev/null || true
        wait "$STEP_PID" 2>/dev/null || true
        record "step.$STEP_NAME.exit" "interrupted (whole-script time limit or signal)"
    fi
    exit 124
}
trap on_signal INT TERM HUP

# run_step NAME LIMIT_S COMMAND...: run COMMAND under its own timeout, copy its output to a log, record its
# exit code and duration; never stops the script.
run_step() {
    local name=$1 limit=$2 rc=0 start
    shift 2
    local log="$OUT_DIR/logs/$name.log" shown="$*"
    shown="${shown//$'\n'/ }"
    echo "== [$name] ${shown:0:160}"
    start=$SECONDS
    STEP_NAME=$name
    timeout --kill-after=15 "$limit" "$@" </dev/null > >(tee "$log") 2>&1 &
    STEP_PID=$!
    wait "$STEP_PID" || rc=$?
    STEP_PID=""
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        record "step.$name.exit" "$rc (timed out after ${limit} s)"
    else
        record "step.$name.exit" "$rc"
    fi
    record "step.$name.seconds" "$((SECONDS - start))"
    if [[ $rc -ne 0 ]]; then
        FAILED+=("$name")
        echo "!! [$name] failed with exit $rc (log: $log)" >&2
    fi
    return 0
}

record "date" "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
record "host" "${HOSTNAME:-$(uname -n)}"
record "commit" "$(git -C "$REPO_ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
record "python" "$("$PY" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null || echo "not runnable: $PY")"

# 1. The driver's view of the GPU.
if command -v nvidia-smi >/dev/null 2>&1; then
    run_step nvidia-smi 30 nvidia-smi
    record "gpu" "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
        | paste -sd ';' - || echo unknown)"
else
    echo "!! nvidia-smi not found: no NVIDIA driver visible on this machine" >&2
    record "step.nvidia-smi.exit" "absent (nvidia-smi not on PATH)"
    FAILED+=("nvidia-smi")
fi

# 2. torch's view of CUDA, and one bf16 matmul figure.
TORCH_JSON="$OUT_DIR/torch_cuda.json"
TORCH_CHECK=$(
    cat <<'PYEOF'
import json, sys, time

import torch

info = {
    "torch": torch.__version__,
    "torch_cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    "cuda_available": torch.cuda.is_available(),
    "device_count": torch.cuda.device_count(),
    "arch_list": torch.cuda.get_arch_list(),
}
if info["cuda_available"]:
    props = torch.cuda.get_device_properties(0)
    info.update(
        gpu=props.name,
        capability=f"{props.major}.{props.minor}",
        memory_gib=round(props.total_memory / 2**30, 1),
        bf16_supported=torch.cuda.is_bf16_supported(),
    )
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    info["bf16_matmul_tflops"] = round(2 * 4096**3 * reps / (time.perf_counter() - start) / 1e12, 1)
with open(sys.argv[1], "w") as f:
    json.dump(info, f, indent=2)
print(json.dumps(info, indent=2))
sys.exit(0 if info["cuda_available"] else 1)
PYEOF
)
run_step torch-cuda 90 "$PY" -c "$TORCH_CHECK" "$TORCH_JSON"
if [[ -s "$TORCH_JSON" ]]; then
    fields="$("$PY" -c '
import json, sys
info = json.load(open(sys.argv[1]))
keys = ("torch", "torch_cuda", "cudnn", "cuda_available", "gpu", "capability", "memory_gib",
        "bf16_supported", "bf16_matmul_tflops")
print("\n".join(f"{key}={info.get(key)}" for key in keys))
' "$TORCH_JSON" 2>/dev/null || true)"
    while IFS= read -r line; do
        if [[ -n "$line" ]]; then record "${line%%=*}" "${line#*=}"; fi
    done <<<"$fields"
else
    record "torch" "unknown (the torch-cuda step wrote nothing)"
fi

# 3. The local swarm on the GPU. The swarm's own --timeout is shorter than the step's, so that it gives up
#    by itself, stops its nodes and still writes its report.
swarm_limit="${GPU_CHECK_SWARM_TIMEOUT:-270}"
run_step swarm "$swarm_limit" "$PY" -m node swarm --nodes 3 --stages 2 --steps 20 --device cuda \
    --timeout "$((swarm_limit > 60 ? swarm_limit - 30 : swarm_limit))" --report "$OUT_DIR/swarm"

# 4. Codec / filter / PowerSGD micro-benchmarks, when this checkout has them.
if "$PY" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("bench.compute.micro") else 3)' \
    2>/dev/null; then
    run_step micro "${GPU_CHECK_MICRO_TIMEOUT:-150}" "$PY" -m bench.compute.micro --device cuda --out "$OUT_DIR/micro.json"
else
    echo "!! bench.compute.micro is not in this checkout (bench/compute/micro.py): micro-benchmarks not run" >&2
    record "step.micro.exit" "absent (no bench/compute/micro.py in this checkout; not counted as a failure)"
fi

if [[ ${#FAILED[@]} -eq 0 ]]; then
    record "overall" "ok"
    status=0
else
    record "overall" "FAILED: ${FAILED[*]}"
    status=1
fi
record "files" "$(cd "$OUT_DIR" && find . -type f | sort | paste -sd ' ' -)"
echo "== summary: $SUMMARY"
cat "$SUMMARY"
exit "$status"
