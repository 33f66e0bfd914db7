#!/usr/bin/env bash
# `make compose-check`: build the four CPU images from docker/Dockerfile and run docker-compose.yml, unchanged, on a
# real Docker engine; then check what a user relies on:
#   1. every service healthy in dependency order; /readyz on each published port; the REST calls of docs/services.md
#   2. fault: the rollout container's process is SIGKILLed mid-run; Docker's restart policy brings it back
#   3. `docker compose down` mid-run, then `up`: the trainer resumes from its checkpoint in the `runs` volume and
#      publishes under a higher weights version than the replicas served before
#   4. the trainer finishes its steps and exits 0; metrics.jsonl and the checkpoints are in the volume; every issued
#      job was trained exactly once (the ledger and the last checkpoint, tests/deploy/compose_probe.py)
#   5. `docker compose down -v` leaves no container, volume or network of the project
# and measures the cold and cached build times, each image's size and user, and what the containers wrote.
#
# Engine: uses a running Docker daemon; otherwise installs Debian's docker.io when dockerd is missing (root) and
# starts a private one (own data root, socket and exec root under $COMPOSE_CHECK_STATE, NAT off so no container
# traffic leaves the machine), stopped again on exit. Compose v2 and buildx come from Debian's packages when the
# client lacks them. Base images: see tests/deploy/compose_standins.sh (the only adaptations for a machine without
# a container registry).
#
# On exit (trap): the project's containers, volumes and network are removed, then the images the check built and,
# for a daemon it started, its whole data root. COMPOSE_CHECK_KEEP=1 keeps images and build cache for a fast rerun.
# Any failed check prints every service's log and exits 1. Timings go to $COMPOSE_CHECK_REPORT (JSON).
set -euo pipefail
cd "$(dirname "$0")/../.."

STATE=${COMPOSE_CHECK_STATE:-/var/lib/rlhf-compose-check}
KEEP=${COMPOSE_CHECK_KEEP:-0}
REPORT=${COMPOSE_CHECK_REPORT:-.cache/compose-check.json}
PROJECT=${COMPOSE_CHECK_PROJECT:-rlhf-compose-check}
SERVICES=(trainer reward reference rollout)  # build order: reward and reference reuse the trainer's layers
PROBE=tests/deploy/compose_probe.py
T_START=$(date +%s)
DOCKERD_PID=
EVENTS_PID=
BUILT_IMAGES=()
declare -A TIMES=()

# shellcheck source=tests/deploy/compose_standins.sh
source tests/deploy/compose_standins.sh

log() { echo "[compose-check] $(date -u +%H:%M:%S) $*" >&2; }
compose() { docker compose -p "$PROJECT" -f docker-compose.yml "$@"; }
now() { date +%s.%N; }
elapsed() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$1" "$(now)"; }

fail() {
    log "FAILED: $*"
    if docker info >/dev/null 2>&1 && [ -n "$(compose ps -aq 2>/dev/null)" ]; then
        compose ps -a >&2 || true
        for svc in redis models reward reference rollout trainer; do
            echo "----- logs: $svc" >&2
            compose logs --no-color --timestamps --tail 120 "$svc" >&2 2>&1 || true
        done
    fi
    exit 1
}

cleanup() {
    local rc=$?
    set +e
    [ -n "$EVENTS_PID" ] && kill "$EVENTS_PID" 2>/dev/null
    standins_stop_wheels
    if docker info >/dev/null 2>&1; then
        compose down -v --remove-orphans --timeout 10 >/dev/null 2>&1
        if [ "$KEEP" != 1 ] && [ -z "$DOCKERD_PID" ]; then  # a daemon we did not start: only what we built
            [ ${#BUILT_IMAGES[@]} -gt 0 ] && docker image rm -f "${BUILT_IMAGES[@]}" >/dev/null 2>&1
        fi
    fi
    if [ -n "$DOCKERD_PID" ]; then
        log "stopping the Docker daemon this check started (pid $DOCKERD_PID)"
        kill "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
        kill -9 "$DOCKERD_PID" 2>/dev/null
        [ "$KEEP" != 1 ] && rm -rf "$STATE/docker" "$STATE/run"
    fi
    log "done in $(($(date +%s) - T_START)) s (exit $rc)"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------------------------------------- engine and tools
as_root() { [ "$(id -u)" = 0 ] || fail "$* needs root (this check installs and starts a Docker engine)"; }

start_engine() {
    if docker info >/dev/null 2>&1; then
        log "using the running Docker daemon ($(docker info -f '{{.ServerVersion}}'))"
        return
    fi
    if ! command -v dockerd >/dev/null; then
        as_root "installing docker.io"
        log "installing Debian's docker.io"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
    fi
    as_root "starting dockerd"
    mkdir -p "$STATE/run"
    export DOCKER_HOST="unix://$STATE/run/docker.sock"
    # NAT off: containers reach each other and published loopback ports, nothing outside; builds use --network host.
    dockerd --data-root "$STATE/docker" --exec-root "$STATE/run/exec" --pidfile "$STATE/run/dockerd.pid" \
        -H "$DOCKER_HOST" --storage-driver overlay2 --iptables=false --ip-forward=false --ip-masq=false \
        >"$STATE/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 120); do
        docker info >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -20 "$STATE/dockerd.log" >&2; DOCKERD_PID=; fail "dockerd exited"; }
        sleep 0.5
    done
    docker info >/dev/null 2>&1 || { tail -20 "$STATE/dockerd.log" >&2; fail "dockerd did not answer in 60 s"; }
    log "started dockerd $(docker info -f '{{.ServerVersion}}') (pid $DOCKERD_PID, data root $STATE/docker)"
}

# Compose v2 and buildx (the Docker 23+ client builds with BuildKit only through buildx). Debian 12 has neither;
# Debian 13's packages carry both plugins, which work with this daemon: extracted into a private DOCKER_CONFIG.
ensure_plugins() {
    docker compose version >/dev/null 2>&1 && docker buildx version >/dev/null 2>&1 && return
    local cfg="$STATE/docker-config" apt_dir="$STATE/apt-trixie"
    if [ ! -x "$cfg/cli-plugins/docker-compose" ] || [ ! -x "$cfg/cli-plugins/docker-buildx" ]; then
        as_root "fetching the compose and buildx plugins"
        log "fetching docker-compose (v2) and docker-buildx from Debian 13's packages"
        mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache" "$apt_dir/debs" "$cfg/cli-plugins"
        echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $(standin_mirror) trixie main" \
            >"$apt_dir/sources.list"
        local opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o Dir::State::status=/dev/null)
        apt-get -qq "${opts[@]}" update
        (cd "$apt_dir/debs" && apt-get -qq "${opts[@]}" download docker-compose docker-buildx 2>/dev/null)
        for deb in "$apt_dir"/debs/*.deb; do dpkg-deb -x "$deb" "$apt_dir/x"; done
        cp "$apt_dir"/x/usr/libexec/docker/cli-plugins/docker-{compose,buildx} "$cfg/cli-plugins/"
        rm -rf "$apt_dir"
    fi
    export DOCKER_CONFIG=$cfg
    docker compose version >/dev/null && docker buildx version >/dev/null || fail "compose/buildx plugins do not run"
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# ------------------------------------------------------------------------------------------------------------ build
image_of() { compose config --format json | python3 -c "import json, sys; print(json.load(sys.stdin)['services']['$1']['image'])"; }

build_all() {  # $1: label for the timing (cold | cached)
    local t0 t svc
    t0=$(now)
    for svc in "${SERVICES[@]}"; do
        t=$(now)
        DOCKER_BUILDKIT=1 docker build --network host -f docker/Dockerfile --target "$svc" --build-arg ACCEL=cpu \
            -t "$(image_of "$svc")" . >"$STATE/build-$svc.log" 2>&1 \
            || { tail -40 "$STATE/build-$svc.log" >&2; fail "docker build --target $svc"; }
        TIMES["build_${1}_$svc"]=$(elapsed "$t")
    done
    TIMES["build_${1}_total"]=$(elapsed "$t0")
    log "$1 build of ${SERVICES[*]}: ${TIMES[build_${1}_total]} s"
}

# ------------------------------------------------------------------------------------------------------- run checks
cid() { compose ps -aq "$1"; }
probe() { python3 "$PROBE" "$@" || fail "compose_probe.py $*"; }
trainer_step() { python3 "$PROBE" status "$RLHF_TRAINER_HTTP_PORT" 2>/dev/null \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["step"])' 2>/dev/null || echo 0; }

wait_for() {  # wait_for SECONDS WHAT COMMAND...: until COMMAND succeeds
    local limit=$1 what=$2
    shift 2
    local deadline=$(($(date +%s) + limit))
    until "$@"; do
        [ "$(date +%s)" -lt "$deadline" ] || fail "timed out after ${limit}s waiting for $what"
        sleep 1
    done
}
step_at_least() { [ "$(trainer_step)" -ge "$1" ]; }
train_iters() { sed -n 's/^ *train_iters: *//p' configs/demo.yaml; }

main() {
    mkdir -p "$STATE" "$(dirname "$REPORT")"
    start_engine
    ensure_plugins
    export RLHF_API_TOKEN=${RLHF_API_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}
    export RLHF_ROLLOUT_HTTP_PORT=$(free_port) RLHF_REWARD_HTTP_PORT=$(free_port)
    export RLHF_REFERENCE_HTTP_PORT=$(free_port) RLHF_TRAINER_HTTP_PORT=$(free_port)
    compose down -v --remove-orphans --timeout 5 >/dev/null 2>&1 || true  # a previous run's leftovers

    # ---- base images, then the four service images (cold, then again: everything cached)
    local python_image redis_image t
    python_image=$(sed -n 's/^ARG PYTHON_IMAGE=//p' docker/Dockerfile)
    redis_image=$(image_of redis)
    t=$(now)
    standins_prepare "$python_image" "$redis_image" || fail "base images"
    TIMES[base_images]=$(elapsed "$t")
    standins_serve_wheels "$python_image" || fail "find-links server"
    for svc in "${SERVICES[@]}"; do BUILT_IMAGES+=("$(image_of "$svc")"); done
    mapfile -t standins < <(standins_images)
    BUILT_IMAGES+=("${standins[@]}")
    build_all cold
    build_all cached
    standins_stop_wheels

    # ---- 1. up: dependency order, readiness. The demo trains about a step a second once the trainer is up, so the
    # faults come first and the REST calls after the run (the three servers keep serving).
    docker events --since "$(date +%s)" --filter "label=com.docker.compose.project=$PROJECT" \
        --format '{{json .}}' >"$STATE/events.jsonl" &
    EVENTS_PID=$!
    t=$(now)
    log "docker compose up -d"
    compose up -d --no-build >"$STATE/up.log" 2>&1 || { cat "$STATE/up.log" >&2; fail "docker compose up"; }
    # the trainer's own HTTP answers before Docker's next health check (every 10 s) would say so
    wait_for 300 "the trainer to train its first step" step_at_least 1
    TIMES[up_to_first_step]=$(elapsed "$t")
    probe ready "$RLHF_ROLLOUT_HTTP_PORT" "$RLHF_REWARD_HTTP_PORT" "$RLHF_REFERENCE_HTTP_PORT" "$RLHF_TRAINER_HTTP_PORT"

    # ---- 2. a crash of the rollout process mid-run. Not `docker kill`: Docker turns a container's restart policy
    # off when it is told to kill it (until it is started again); a crash is a SIGKILL it did not send.
    local rollout pid restarts before
    rollout=$(cid rollout)
    pid=$(docker inspect -f '{{.State.Pid}}' "$rollout")
    before=$(trainer_step)
    log "SIGKILL to the rollout container's process (host pid $pid) at step $before"
    kill -9 "$pid"
    t=$(now)
    wait_for 120 "Docker to restart rollout" bash -c \
        "[ \"\$(docker inspect -f '{{.RestartCount}}' $rollout)\" -ge 1 ]"
    wait_for 300 "the restarted rollout to be ready" bash -c \
        "python3 $PROBE ready $RLHF_ROLLOUT_HTTP_PORT >/dev/null 2>&1"
    TIMES[rollout_restart_to_ready]=$(elapsed "$t")
    restarts=$(docker inspect -f '{{.RestartCount}}' "$rollout")
    before=$(trainer_step)
    wait_for 300 "a training step after the restart" step_at_least $((before + 1))
    log "rollout restarted by Docker (restart count $restarts, ready again after" \
        "${TIMES[rollout_restart_to_ready]} s); trainer at step $(trainer_step)"

    # ---- 3. down (volumes kept) mid-run, then up: resume from the checkpoint under a higher version
    local served_before step_before
    served_before=$(python3 "$PROBE" version "$RLHF_ROLLOUT_HTTP_PORT") || fail "rollout version"
    step_before=$(trainer_step)
    log "docker compose down at step $step_before (rollout serving version $served_before)"
    t=$(now)
    compose down --timeout 60 >"$STATE/down.log" 2>&1 || { cat "$STATE/down.log" >&2; fail "docker compose down"; }
    TIMES[down]=$(elapsed "$t")
    [ -z "$(compose ps -aq)" ] || fail "containers left after docker compose down"
    t=$(now)
    compose up -d --no-build >>"$STATE/up.log" 2>&1 || { cat "$STATE/up.log" >&2; fail "docker compose up (again)"; }
    local resumed resumed_step resumed_version served_after
    wait_for 300 "the trainer to resume" bash -c "docker logs $(cid trainer) 2>&1 | grep -q 'resumed from '"
    TIMES[second_up_to_resume]=$(elapsed "$t")
    resumed=$(docker logs "$(cid trainer)" 2>&1 | grep -o 'resumed from .* at step [0-9]*, publishing as version [0-9]*')
    resumed_step=$(sed -E 's/.* at step ([0-9]+),.*/\1/' <<<"$resumed")
    resumed_version=$(sed -E 's/.* version ([0-9]+)$/\1/' <<<"$resumed")
    [ "$resumed_step" -ge "$step_before" ] || fail "resumed at step $resumed_step, before the $step_before trained"
    [ "$resumed_step" -lt "$(train_iters)" ] || fail "the run had finished before the down (step $resumed_step)"
    [ "$resumed_version" -gt "$served_before" ] || fail "resumed as version $resumed_version <= $served_before"
    wait_for 300 "rollout to serve the resumed weights" bash -c \
        "[ \"\$(python3 $PROBE version $RLHF_ROLLOUT_HTTP_PORT 2>/dev/null || echo 0)\" -ge $resumed_version ]"
    served_after=$(python3 "$PROBE" version "$RLHF_ROLLOUT_HTTP_PORT")
    log "trainer $resumed; rollout serves version $served_after (was $served_before before the down)"

    # ---- 4. the run finishes: exit 0, files in the volume, the ledger
    local trainer code
    trainer=$(cid trainer)
    code=$(timeout 600 docker wait "$trainer") || fail "the trainer did not finish within 600 s"
    [ "$code" = 0 ] || fail "the trainer exited $code"
    TIMES[run_total]=$(python3 -c "print(round($(now) - $T_START, 1))")
    log "trainer exited 0"
    probe ready "$RLHF_ROLLOUT_HTTP_PORT" "$RLHF_REWARD_HTTP_PORT" "$RLHF_REFERENCE_HTTP_PORT"
    probe rest "$RLHF_ROLLOUT_HTTP_PORT" "$RLHF_REWARD_HTTP_PORT" "$RLHF_REFERENCE_HTTP_PORT"
    probe order "$STATE/events.jsonl"
    local ledger
    ledger=$(docker run --rm --network none --entrypoint python3 -v "${PROJECT}_runs:/var/lib/rlhf/runs:ro" \
        -v "$PWD/$PROBE:/tmp/compose_probe.py:ro" -v "$PWD/configs/demo.yaml:/tmp/demo.yaml:ro" \
        "$(image_of trainer)" /tmp/compose_probe.py ledger /var/lib/rlhf/runs/demo /tmp/demo.yaml) \
        || fail "the run's files in the runs volume"
    log "ledger: $ledger"

    # ---- image facts: size, user, what the running containers wrote outside their volumes
    local facts="" svc img wrote
    for svc in "${SERVICES[@]}"; do
        img=$(image_of "$svc")
        facts+="\"$svc\": {\"size_mb\": $(($(docker image inspect -f '{{.Size}}' "$img") / 1000000)),"
        facts+=" \"user\": \"$(docker image inspect -f '{{.Config.User}}' "$img")\"},"
        [ "$(docker image inspect -f '{{.Config.User}}' "$img")" = 10001:10001 ] || fail "$img does not run as 10001"
    done
    local added=""
    for svc in reward reference rollout trainer; do
        # Anything a service fetched at start would land in site-packages or a download cache: nothing may. (The
        # containers cannot reach outside this machine either: the daemon runs with NAT off.)
        wrote=$(docker diff "$(cid "$svc")" | awk '$1 == "A" {print $2}')
        if grep -E 'site-packages|dist-packages|huggingface|/\.cache/pip' <<<"$wrote"; then
            fail "$svc wrote packages or downloads at start"
        fi
        added+="\"$svc\": $(python3 -c 'import json, sys; print(json.dumps(sys.argv[1].split()))' "$wrote"),"
    done
    # item 2 of issue 14: the rollout's warnings a real run showed are gone
    for warning in "numa_set_membind failed" "Failed to load weights"; do
        if docker logs "$(cid rollout)" 2>&1 | grep -m3 "$warning"; then fail "the rollout logged '$warning'"; fi
    done

    # ---- 5. down -v leaves nothing
    compose down -v --timeout 10 >/dev/null 2>&1 || fail "docker compose down -v"
    local left
    left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")
    left+=$(docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT")
    left+=$(docker network ls -q --filter "label=com.docker.compose.project=$PROJECT")
    [ -z "$left" ] || fail "left after docker compose down -v: $left"
    log "docker compose down -v: no container, volume or network of $PROJECT left"

    TIMES[check_total]=$(($(date +%s) - T_START))
    python3 - "$REPORT" "{${facts%,}}" "$ledger" "$resumed" "$served_before" "$served_after" "$(declare -p TIMES)" \
        "$step_before" "$restarts" "{${added%,}}" <<'PY'
import json, re, sys
report, images, ledger, resumed, before, after, times, step_before, restarts, added = sys.argv[1:]
t = {k: float(v) for k, v in re.findall(r'\[(\w+)\]="([0-9.]+)"', times)}
out = {"images": json.loads(images), "ledger": json.loads(ledger), "resume": resumed,
       "served_version_before_down": int(before), "served_version_after_up": int(after), "seconds": t,
       "step_at_down": int(step_before), "rollout_restart_count": int(restarts),
       "files_added_outside_volumes": json.loads(added)}
open(report, "w").write(json.dumps(out, indent=1, sort_keys=True) + "\n")
print(json.dumps(out))
PY
    log "all checks passed; report in $REPORT"
}

main "$@"
