# shellcheck shell=bash
# Every adaptation `make compose-check` makes for a machine that reaches no container registry, and nothing else.
# Sourced by tests/deploy/compose_check.sh. docker/Dockerfile and docker-compose.yml are built and run unchanged;
# what changes is what their base-image names resolve to:
#
#   python:3.11.7-slim-bookworm  a stand-in: Debian 12's python3.11 with a venv at /usr/local (python, python3, pip
#                                where the official image has them) on a `debootstrap --variant=minbase` root file
#                                system. pip inside the builds reaches PyPI through this workplace's TLS-inspecting
#                                proxy, so the stand-in carries the host's CA bundle (PIP_CERT), tries the unreachable
#                                PyTorch index once (PIP_RETRIES=1), takes PyPI as an extra index, and finds the local
#                                torch CPU wheel through a find-links folder the check serves on 127.0.0.1 while it
#                                builds (PIP_FIND_LINKS). Those PIP_* variables are inherited by the images built on it.
#   redis:7.2.5-alpine           a stand-in: Debian 12's redis-server 7.0 (run as the redis user in /data, as the
#                                official image does); redis-cli, sh and grep for the healthcheck.
#
# Each is built only when the real image is neither present nor pullable, and is labelled
# org.rlhf-pipeline.standin=true. Nothing here is used where a registry answers.

STANDIN_LABEL=org.rlhf-pipeline.standin=true
STANDIN_DEBIAN=rlhf-standin/debian:bookworm
# the find-links server the python stand-in points pip at (baked into its PIP_FIND_LINKS)
STANDIN_WHEEL_PORT=${COMPOSE_CHECK_WHEEL_PORT:-39617}
STANDIN_WHEEL_PID=

standin_log() { echo "[compose-check] $(date -u +%H:%M:%S) stand-ins: $*" >&2; }

# The Debian mirror apt uses here (deb822 or one-line sources), else deb.debian.org.
standin_mirror() {
    local uri
    uri=$(grep -hE '^URIs:.*/debian/?$' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')
    [ -n "$uri" ] || uri=$(grep -hE '^deb .*/debian/? ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        2>/dev/null | head -1 | awk '{for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}')
    echo "${uri:-http://deb.debian.org/debian}"
}

# The folder pip's find-links setting names on this machine (it holds the local torch CPU wheel).
standin_wheel_dir() {
    local dir=${PIP_FIND_LINKS:-}
    [ -n "$dir" ] || dir=$(python3 -m pip config get global.find-links 2>/dev/null || true)
    dir=${dir%% *}
    dir=${dir#file://}
    [ -d "$dir" ] || { standin_log "no find-links folder in pip's settings (PIP_FIND_LINKS / global.find-links):" \
        "the CPU torch wheel cannot be found without the PyTorch index"; return 1; }
    echo "$dir"
}

standin_ca_bundle() {
    local ca=${PIP_CERT:-}
    [ -n "$ca" ] || ca=$(python3 -m pip config get global.cert 2>/dev/null || true)
    [ -f "$ca" ] || ca=/etc/ssl/certs/ca-certificates.crt
    echo "$ca"
}

standin_pullable() {
    docker image inspect "$1" >/dev/null 2>&1 && return 0
    timeout 60 docker pull -q "$1" >/dev/null 2>&1
}

standin_debian() {
    docker image inspect "$STANDIN_DEBIAN" >/dev/null 2>&1 && return 0
    command -v debootstrap >/dev/null || apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
    local rootfs mirror
    rootfs=$(mktemp -d "${TMPDIR:-/tmp}/rlhf-standin-rootfs.XXXXXX")
    mirror=$(standin_mirror)
    standin_log "debootstrap --variant=minbase bookworm from $mirror"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
        || { tail -20 "$rootfs.log" >&2; rm -rf "$rootfs" "$rootfs.log"; return 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import --change "LABEL $STANDIN_LABEL" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$STANDIN_DEBIAN" >/dev/null
    rm -rf "$rootfs" "$rootfs.log"
}

standin_python() {  # $1: the image name docker/Dockerfile's PYTHON_IMAGE names
    local ctx
    ctx=$(mktemp -d "${TMPDIR:-/tmp}/rlhf-standin-python.XXXXXX")
    cp "$(standin_ca_bundle)" "$ctx/ca-certificates.crt"
    cat >"$ctx/Dockerfile" <<EOF
FROM $STANDIN_DEBIAN
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \\
    && rm -rf /var/lib/apt/lists/* && python3.11 -m venv /usr/local && /usr/local/bin/python3 -m pip --version
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
ENV LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_RETRIES=1 \\
    PIP_EXTRA_INDEX_URL=https://pypi.org/simple PIP_FIND_LINKS=http://127.0.0.1:$STANDIN_WHEEL_PORT/
LABEL $STANDIN_LABEL
CMD ["python3"]
EOF
    standin_log "building $1 (Debian python3.11 + venv at /usr/local)"
    docker build -q --network host -t "$1" "$ctx" >/dev/null
    rm -rf "$ctx"
}

standin_redis() {  # $1: the image name docker-compose.yml's redis service names
    local ctx
    ctx=$(mktemp -d "${TMPDIR:-/tmp}/rlhf-standin-redis.XXXXXX")
    cat >"$ctx/Dockerfile" <<EOF
FROM $STANDIN_DEBIAN
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \\
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
LABEL $STANDIN_LABEL
CMD ["redis-server"]
EOF
    standin_log "building $1 (Debian redis-server)"
    docker build -q --network host -t "$1" "$ctx" >/dev/null
    rm -rf "$ctx"
}

# standins_prepare PYTHON_IMAGE REDIS_IMAGE: make both names resolve, pulling where a registry answers.
standins_prepare() {
    local python_image=$1 redis_image=$2 need=()
    standin_pullable "$python_image" || need+=(python)
    standin_pullable "$redis_image" || need+=(redis)
    [ ${#need[@]} -gt 0 ] || return 0
    standin_log "no registry for ${need[*]}: building local stand-ins"
    standin_debian
    for what in "${need[@]}"; do
        case $what in
        python) standin_python "$python_image" ;;
        redis) standin_redis "$redis_image" ;;
        esac
    done
}

# The find-links server for builds on the python stand-in (a no-op when the real image is used).
standins_serve_wheels() {
    local python_image=$1 dir
    docker image inspect -f '{{index .Config.Labels "org.rlhf-pipeline.standin"}}' "$python_image" 2>/dev/null \
        | grep -q true || return 0
    dir=$(standin_wheel_dir)
    python3 -m http.server --bind 127.0.0.1 --directory "$dir" "$STANDIN_WHEEL_PORT" >/dev/null 2>&1 &
    STANDIN_WHEEL_PID=$!
    for _ in $(seq 50); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$STANDIN_WHEEL_PORT/', timeout=1)" \
            2>/dev/null && return 0
        kill -0 "$STANDIN_WHEEL_PID" 2>/dev/null || break
        sleep 0.1
    done
    standin_log "could not serve $dir on 127.0.0.1:$STANDIN_WHEEL_PORT (set COMPOSE_CHECK_WHEEL_PORT to a free port)"
    return 1
}

standins_stop_wheels() {
    if [ -n "$STANDIN_WHEEL_PID" ]; then
        kill "$STANDIN_WHEEL_PID" 2>/dev/null || true
        wait "$STANDIN_WHEEL_PID" 2>/dev/null || true
        STANDIN_WHEEL_PID=
    fi
}

# Every stand-in image (for the check's clean-up).
standins_images() {
    docker image ls -q --filter "label=$STANDIN_LABEL" 2>/dev/null | sort -u
}
