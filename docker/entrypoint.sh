#!/bin/bash
# Image entrypoint: loads the Ascend CANN environment when the image has one (the CANN and vllm-ascend bases), then
# runs the command (`rlhf serve ...`, or `torchrun ... -m services.cli serve trainer ...`).
for env_script in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh; do
    if [ -f "$env_script" ]; then
        # shellcheck disable=SC1090
        . "$env_script" >/dev/null 2>&1 || echo "entrypoint: could not load $env_script" >&2
    fi
done
exec "$@"
