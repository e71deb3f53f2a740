#!/usr/bin/env bash
# The Docker image, built and run for real (issue 19). From the repository root:
#   bench/docker_smoke.sh                                   # build against python:3.11-slim-bookworm
#   BASE_IMAGE=my/python:3.11-slim-bookworm bench/docker_smoke.sh   # against a local base image
# It builds the image, runs `join --help` and `health` in it, runs a two-container CPU swarm (host
# network, tiny model, 2 stages) until the head has trained STEPS inner steps, stops both with a plain
# `docker stop` (Docker's default 10 s) and validates the compose files. No container gets `--init`:
# the head runs the image's entrypoint (tini), the tail runs the node itself as PID 1.
# Writes bench/results/docker.json and bench/results/docker.md. Env: IMAGE (default volunteer-node),
# STEPS (default 5), NO_CACHE=1 (build without the layer cache), SKIP_BUILD=1 (reuse IMAGE),
# TRAIN_TIMEOUT_S (default 600).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! docker info >/dev/null 2>&1; then
    echo "docker_smoke: no Docker engine answers (\`docker info\` failed): start dockerd, or run this where one runs"
    exit 1
fi

IMAGE=${IMAGE:-volunteer-node}
STEPS=${STEPS:-5}
TRAIN_TIMEOUT_S=${TRAIN_TIMEOUT_S:-600}
OUT=bench/results
LOGS=$(mktemp -d /tmp/docker_smoke.XXXXXX)
HEAD=vn-smoke-head
TAIL=vn-smoke-tail
VOLS=(vn-smoke-head-state vn-smoke-tail-state)
NODE_ARGS=(--model tiny:4 --device cpu --threads 1 --host 127.0.0.1)

cleanup() {
    docker rm -f "$HEAD" "$TAIL" >/dev/null 2>&1 || true
    docker volume rm "${VOLS[@]}" >/dev/null 2>&1 || true
}
trap cleanup EXIT
cleanup

now() { date +%s.%N; }
secs() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$1" "$2"; }
free_port() { python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# --- build --------------------------------------------------------------------------------------------
build_s=null
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    build_args=()
    [ -n "${BASE_IMAGE:-}" ] && build_args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
    [ "${NO_CACHE:-0}" = 1 ] && build_args+=(--no-cache)
    echo "building $IMAGE (log: $LOGS/build.log)"
    t0=$(now)
    docker build --network host "${build_args[@]}" -f docker/Dockerfile -t "$IMAGE" . >"$LOGS/build.log" 2>&1 \
        || { tail -20 "$LOGS/build.log"; echo "docker_smoke: the build failed (log: $LOGS/build.log)"; exit 1; }
    build_s=$(secs "$t0" "$(now)")
fi
# pip's layers taken from the cache make build_s no build time
build_from_cache=False
grep -A2 'pip install --no-cache-dir --constraint /opt/constraints.txt torch' "$LOGS/build.log" 2>/dev/null \
    | grep -q 'Using cache' && build_from_cache=True
image_bytes=$(docker image inspect -f '{{.Size}}' "$IMAGE")

# The image holds exactly the versions of docker/constraints.txt (pip and the project itself aside).
docker run --rm --network host --entrypoint pip "$IMAGE" freeze --all --exclude pip --exclude volunteer-node \
    | sort -f >"$LOGS/freeze.txt"
grep -v '^#' docker/constraints.txt | sed '/^$/d' | sort -f >"$LOGS/constraints.txt"
freeze_matches=False
diff "$LOGS/constraints.txt" "$LOGS/freeze.txt" >"$LOGS/freeze.diff" && freeze_matches=True

# --- one-shot commands, no --init, no volumes -----------------------------------------------------------
# Each runs as a named container, so that its mounts can be counted (a declared VOLUME would show as one).
oneshot() {
    local name=vn-smoke-$1 rc mounts
    shift
    docker rm -f "$name" >/dev/null 2>&1 || true
    set +e
    docker run --name "$name" --network host "$IMAGE" "$@" >"$LOGS/$name.txt" 2>&1
    rc=$?
    set -e
    mounts=$(docker inspect -f '{{len .Mounts}}' "$name")
    docker rm -v "$name" >/dev/null
    echo "$rc $mounts"
}
read -r help_rc help_mounts < <(oneshot help join --help)
read -r health_rc health_mounts < <(oneshot health health)
cp "$LOGS/vn-smoke-help.txt" "$LOGS/help.txt"
cp "$LOGS/vn-smoke-health.txt" "$LOGS/health.txt"
help_lists_peers=False
grep -q -- '--peers' "$LOGS/help.txt" && help_lists_peers=True

# --- two-container CPU swarm ------------------------------------------------------------------------------
head_port=$(free_port)
tail_port=$(free_port)
echo "swarm: head on port $head_port, tail on port $tail_port, $STEPS steps"
t_swarm=$(now)
docker run -d --name "$HEAD" --network host -v "${VOLS[0]}:/data/state" "$IMAGE" \
    join --stages 2 --port "$head_port" --metrics-file /data/state/metrics.json "${NODE_ARGS[@]}" >/dev/null

# The head prints the command others join with; it carries --model (issue 19.2).
join_line=""
for _ in $(seq 1 180); do
    join_line=$(docker logs "$HEAD" 2>&1 | grep -m1 -- '^ *python -m node join --peers' || true)
    [ -n "$join_line" ] && break
    [ "$(docker inspect -f '{{.State.Running}}' "$HEAD")" = true ] || break
    sleep 1
done
if [ -z "$join_line" ]; then
    docker logs "$HEAD" 2>&1 | tail -20
    echo "docker_smoke: the head printed no join command"
    exit 1
fi
read -r -a join_argv <<<"$join_line"
head_pid1=$(docker exec "$HEAD" cat /proc/1/comm)
# The tail: the node itself as PID 1 (no tini, no --init), as with an overridden entrypoint.
docker run -d --name "$TAIL" --network host -v "${VOLS[1]}:/data/state" --entrypoint python "$IMAGE" \
    "${join_argv[@]:1}" --port "$tail_port" --device cpu --threads 1 --host 127.0.0.1 \
    --metrics-file /data/state/metrics.json >/dev/null
tail_pid1=$(docker exec "$TAIL" cat /proc/1/comm)

head_step=0
deadline=$(( $(date +%s) + TRAIN_TIMEOUT_S ))
while [ "$(date +%s)" -lt "$deadline" ]; do
    line=$(docker exec "$HEAD" python -m node health 2>&1 || true)
    head_step=$(sed -n 's/.*inner step \([0-9]*\).*/\1/p' <<<"$line")
    head_step=${head_step:-0}
    head_health=$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$HEAD")
    # Docker runs the image's HEALTHCHECK every 30 s: wait for its verdict as well
    [ "$head_step" -ge "$STEPS" ] && [ "$head_health" != starting ] && break
    for c in "$HEAD" "$TAIL"; do
        if [ "$(docker inspect -f '{{.State.Running}}' "$c")" != true ]; then
            docker logs "$c" 2>&1 | tail -20
            echo "docker_smoke: $c exited before the head trained $STEPS steps"
            exit 1
        fi
    done
    sleep 2
done
train_s=$(secs "$t_swarm" "$(now)")

# A plain `docker stop`: SIGTERM, then SIGKILL after Docker's default 10 s. The head first, so that the
# tail is not stopped under a microbatch in flight.
stop() {
    local t0 rc
    t0=$(now)
    docker stop "$1" >/dev/null
    rc=$(docker inspect -f '{{.State.ExitCode}}' "$1")
    echo "$(secs "$t0" "$(now)") $rc"
}
read -r head_stop_s head_rc < <(stop "$HEAD")
read -r tail_stop_s tail_rc < <(stop "$TAIL")
docker logs "$HEAD" >"$LOGS/head.log" 2>&1
docker logs "$TAIL" >"$LOGS/tail.log" 2>&1

# What each node left in its state volume: metrics (written last on stop) and its checkpoints.
read_state() {
    docker run --rm -v "$1:/data/state" --entrypoint python "$IMAGE" -c '
import json, pathlib
m = json.loads(pathlib.Path("/data/state/metrics.json").read_text())
ck = sorted(p.name for p in pathlib.Path("/data/state/checkpoints").rglob("ckpt-*"))
print(json.dumps({"inner_step": m["inner_step"], "step_losses": m["step_losses"], "checkpoints": ck}))'
}
head_state=$(read_state "${VOLS[0]}")
tail_state=$(read_state "${VOLS[1]}")

# --- compose ------------------------------------------------------------------------------------------------
compose_tool=$(docker-compose version --short 2>/dev/null || echo none)
set +e
docker-compose -f docker/compose.yml config -q 2>"$LOGS/compose_cpu.txt"
compose_cpu_rc=$?
docker-compose -f docker/compose.yml -f docker/compose.gpu.yml config -q 2>"$LOGS/compose_gpu.txt"
compose_gpu_rc=$?
set -e

# --- report ------------------------------------------------------------------------------------------------
python3 - "$OUT" <<EOF
import json, sys
head, tail = json.loads('''$head_state'''), json.loads('''$tail_state''')
r = {
    "image": "$IMAGE",
    "base_image": "${BASE_IMAGE:-python:3.11-slim-bookworm}",
    "image_bytes": $image_bytes,
    "image_gb": round($image_bytes / 1e9, 2),
    "build_s": $build_s,
    "build_from_cache": $build_from_cache,
    "freeze_matches_constraints": $freeze_matches,
    "join_help_rc": $help_rc,
    "join_help_lists_peers": $help_lists_peers,
    "health_without_node_rc": $health_rc,
    "health_without_node_output": open("$LOGS/health.txt").read().strip(),
    "volumes_mounted_by_help_and_health": $help_mounts + $health_mounts,
    "swarm": {
        "model": "tiny:4", "stages": 2, "network": "host", "device": "cpu", "init_flag": False,
        "pid1": {"head": "$head_pid1", "tail": "$tail_pid1"},
        "head_steps_seen_before_stop": $head_step,
        "seconds_before_stop": $train_s,
        "head_docker_health": "$head_health",
        "steps_trained": {"head": head["inner_step"], "tail": tail["inner_step"]},
        "tail_losses": tail["step_losses"],
        "checkpoints": {"head": head["checkpoints"], "tail": tail["checkpoints"]},
        "stop_s": {"head": $head_stop_s, "tail": $tail_stop_s},
        "exit_codes": {"head": $head_rc, "tail": $tail_rc},
    },
    "compose": {"tool": "docker-compose $compose_tool", "cpu_config_rc": $compose_cpu_rc,
                "gpu_override_config_rc": $compose_gpu_rc},
}
out = sys.argv[1]
with open(f"{out}/docker.json", "w") as f:
    json.dump(r, f, indent=2)
    f.write("\n")
s = r["swarm"]
losses = s["tail_losses"]
md = f"""# Docker smoke test (bench/docker_smoke.sh)

| | |
|---|---|
| image | {r['image']} from {r['base_image']}, {r['image_gb']} GB |
| build | {r['build_s']} s{' (layers from the cache)' if r['build_from_cache'] else ''} |
| installed versions = docker/constraints.txt | {r['freeze_matches_constraints']} |
| \`docker run IMAGE join --help\` (no --init) | exit {r['join_help_rc']} |
| \`docker run IMAGE health\`, no node | exit {r['health_without_node_rc']}: {r['health_without_node_output']} |
| volumes those two mounted | {r['volumes_mounted_by_help_and_health']} |
| swarm | 2 containers, --network host, tiny:4, 2 stages, CPU, no --init (PID 1: head {s['pid1']['head']}, tail {s['pid1']['tail']}) |
| steps trained | head {s['steps_trained']['head']}, tail {s['steps_trained']['tail']} (stopped {s['seconds_before_stop']} s after the head started) |
| tail loss | {losses[0] if losses else '-'} -> {losses[-1] if losses else '-'} over {len(losses)} steps |
| head's Docker health before stop | {s['head_docker_health'] or '-'} |
| plain \`docker stop\` (10 s default) | head {s['stop_s']['head']} s, exit {s['exit_codes']['head']}; tail {s['stop_s']['tail']} s, exit {s['exit_codes']['tail']} |
| checkpoints after stop | head {s['checkpoints']['head']}, tail {s['checkpoints']['tail']} |
| compose ({r['compose']['tool']}) config | CPU file exit {r['compose']['cpu_config_rc']}, with GPU override exit {r['compose']['gpu_override_config_rc']} |
"""
with open(f"{out}/docker.md", "w") as f:
    f.write(md)
print(md)
EOF
echo "logs: $LOGS"
