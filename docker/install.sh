#!/bin/sh
# Installs rlhf-pipeline into an image whose base already carries torch (and, for rollout, vLLM).
#
#   install.sh deps SRC          the requirements in SRC/pyproject.toml except torch, pinned around the base's
#                                accelerator stack: torch*, vllm*, triton*, nvidia-* and transformers stay exactly as the
#                                base ships them, and the build fails if a requirement cannot live with them
#   install.sh extra TOML NAME   the optional dependencies NAME of the pyproject.toml TOML, pinned like deps
#   install.sh app SRC UID GID   the project itself (no dependencies), the `rlhf` user, and the writable directories
set -eu
cmd=$1
src=$2

# the base's accelerator stack, pinned as it ships: /tmp/base-constraints.txt
base_constraints() {
    python3 -m pip list --format=freeze 2>/dev/null \
        | grep -iE '^(torch|torch[-_][a-z0-9_-]*|vllm[a-z0-9_-]*|triton[a-z0-9_-]*|nvidia[-_][a-z0-9_-]*|transformers)==' \
        > /tmp/base-constraints.txt || true
}

case "$cmd" in
deps)
    base_constraints
    python3 - "$src/pyproject.toml" > /tmp/requirements.txt <<'PY'
import re
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    for dep in tomllib.load(f)["project"]["dependencies"]:
        if re.split(r"[\s<>=!~;\[]", dep, maxsplit=1)[0].lower() != "torch":
            print(dep)
PY
    python3 -m pip install -c /tmp/base-constraints.txt -r /tmp/requirements.txt
    rm -f /tmp/base-constraints.txt /tmp/requirements.txt
    ;;
extra)
    base_constraints
    python3 - "$src" "$3" > /tmp/requirements.txt <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"][sys.argv[2]]))
PY
    python3 -m pip install -c /tmp/base-constraints.txt -r /tmp/requirements.txt
    rm -f /tmp/base-constraints.txt /tmp/requirements.txt
    ;;
app)
    uid=$3
    gid=$4
    python3 -m pip install --no-deps "$src"
    rm -rf "$src"
    command -v rlhf >/dev/null
    python3 -c "import rlhf.config, services"
    getent group "$gid" >/dev/null || groupadd --gid "$gid" rlhf
    useradd --uid "$uid" --gid "$gid" --create-home --home-dir /home/rlhf --shell /usr/sbin/nologin rlhf
    mkdir -p /etc/rlhf /var/cache/rlhf /var/lib/rlhf/runs
    cp /opt/rlhf/configs/demo.yaml /etc/rlhf/config.yaml
    chown -R "$uid:$gid" /var/cache/rlhf /var/lib/rlhf
    chmod 0755 /opt/rlhf/entrypoint.sh
    ;;
*)
    echo "usage: install.sh deps SRC | extra TOML NAME | app SRC UID GID" >&2
    exit 2
    ;;
esac
