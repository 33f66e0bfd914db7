#!/usr/bin/env bash
# Static checks of the deployment files (no cluster, no Docker engine). `make deploy-check` installs the tools and
# runs this with HELM, TOOLS_BIN (hadolint, kubernetes-validate, yamllint), PY (the project's Python) and
# DOCKER_COMPOSE set. Each check prints one line; a failing one also prints its output. Exit status 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${HELM:?set HELM}" "${TOOLS_BIN:?set TOOLS_BIN}" "${PY:?set PY}"
DOCKER_COMPOSE=${DOCKER_COMPOSE:-docker-compose}
CHART=k8s/rlhf-pipeline
GPU=(-f k8s/examples/values-gpu.yaml --set-file experiment.configYaml=configs/llama32-1b-ppo.yaml)
NPU=(-f k8s/examples/values-npu.yaml --set-file experiment.configYaml=configs/llama32-1b-ppo.yaml)
# weights by one HCCL broadcast between pods: only on the node's network (or a declared RoCE fabric), issue 27.5
NPU_HCCL=(--set weightSync.transport=collective --set weightSync.collectiveBackend=hccl)
NPU_HOSTNET=(--set weightSync.hostNetwork=true --set rollout.replicas=1
    --set-json 'networkPolicy.nodesFrom=[{"ipBlock": {"cidr": "10.0.0.0/16"}}]')
export RLHF_API_TOKEN=deploy-check

failed=()
count=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
now_ds() { local us=${EPOCHREALTIME/./}; echo $((us / 100000)); }  # tenths of a second (bash 5)
fmt_ds() { printf '%d.%ds' $(($1 / 10)) $(($1 % 10)); }
start_all=$(now_ds)

check() {  # check NAME COMMAND...
    local name=$1 t0 dt
    shift
    count=$((count + 1))
    t0=$(now_ds)
    if "$@" >"$log" 2>&1; then
        printf '  ok    %-66s %6s\n' "$name" "$(fmt_ds $(($(now_ds) - t0)))"
    else
        printf '  FAIL  %-66s %6s\n' "$name" "$(fmt_ds $(($(now_ds) - t0)))"
        sed 's/^/        /' "$log"
        failed+=("$name")
    fi
}

compose() { $DOCKER_COMPOSE "$@"; }
compose_needs_token() {  # the base file refuses to start without RLHF_API_TOKEN
    ! env -u RLHF_API_TOKEN $DOCKER_COMPOSE -f docker-compose.yml config -q
}
validate() {  # helm template ... | kubernetes-validate --strict
    "$HELM" template rlhf "$CHART" "$@" | "$TOOLS_BIN/kubernetes-validate" --strict --quiet -
}
refuses() {  # helm template must fail (the schema or a guard rejects the values)
    ! "$HELM" template rlhf "$CHART" "$@"
}
refuses_saying() {  # refuses_saying MESSAGE ARGS...: helm template fails and its error contains MESSAGE
    local message=$1 out
    shift
    if out=$("$HELM" template rlhf "$CHART" "$@" 2>&1); then
        echo "accepted: $*"
        return 1
    fi
    grep -qF -- "$message" <<<"$out" || { echo "$out"; echo "(expected: $message)"; return 1; }
}
# KEDA on for rollout (redis-streams) and reward/reference (prometheus), as docs/deploy.md#scaling-signals installs it
KEDA_ALL=(--set rollout.autoscaling.keda.enabled=true --set reward.autoscaling.keda.enabled=true
    --set reference.autoscaling.keda.enabled=true --set serviceMonitor.enabled=true
    --set autoscaling.prometheus.serverAddress=http://prometheus-operated.monitoring:9090)
keda_valid() {  # helm template ... | keda_check.py: KEDA's CRD schema (cloudcoil-models-keda) and trigger metadata
    "$HELM" template rlhf "$CHART" "$@" | "$TOOLS_BIN/python" tests/deploy/keda_check.py
}
keda_refuses() {  # keda_refuses SED ARGS...: the render, edited by SED, must fail keda_check.py
    local edit=$1
    shift
    ! "$HELM" template rlhf "$CHART" "$@" | sed "$edit" | "$TOOLS_BIN/python" tests/deploy/keda_check.py
}
soc_render() {  # soc_render SOC: every Ascend workload runs the -ascend-SOC image and only on SOC's node types
    "$HELM" template rlhf "$CHART" "${NPU[@]}" --set "ascend.soc=$1" | "$PY" -c '
import sys, yaml
soc = sys.argv[1]
types = {"910b": {"module-910b-8", "module-910b-16", "card-910b-2"}, "a3": {"module-a3-16", "module-a3-16-super-pod"}}
n = 0
for d in yaml.safe_load_all(sys.stdin):
    if not d or d["kind"] not in ("Deployment", "Job"):
        continue
    spec = d["spec"]["template"]["spec"]
    image = spec["containers"][0]["image"]
    assert image.endswith("-ascend-" + soc), image
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    for term in terms:
        (expr,) = [e for e in term["matchExpressions"] if e["key"] == "accelerator-type"]
        assert expr["operator"] == "In" and set(expr["values"]) == types[soc], (d["metadata"]["name"], expr)
    n += 1
assert n == 4, n
print(soc, "ok:", n, "workloads")
' "$1"
}

echo "deploy-check: Dockerfile"
check "hadolint docker/Dockerfile" "$TOOLS_BIN/hadolint" docker/Dockerfile
check "shell syntax of docker/*.sh and the compose-check scripts" bash -c 'bash -n docker/entrypoint.sh && sh -n docker/install.sh && bash -n tests/deploy/compose_check.sh && bash -n tests/deploy/compose_standins.sh'

echo "deploy-check: docker compose ($($DOCKER_COMPOSE version --short 2>/dev/null || echo '?'))"
check "compose: docker-compose.yml" compose -f docker-compose.yml config -q
check "compose: + compose.gpu.yaml" compose -f docker-compose.yml -f compose.gpu.yaml config -q
check "compose: + compose.npu.yaml" compose -f docker-compose.yml -f compose.npu.yaml config -q
check "compose: + compose.npu.yaml, RLHF_ASCEND_SOC=a3" env RLHF_ASCEND_SOC=a3 \
    $DOCKER_COMPOSE -f docker-compose.yml -f compose.npu.yaml config -q
check "compose: + compose.npu.yaml + compose.npu-hccl.yaml (host network)" \
    compose -f docker-compose.yml -f compose.npu.yaml -f compose.npu-hccl.yaml config -q
check "compose: --profile training (training service)" compose -f docker-compose.yml --profile training config -q
check "compose: + compose.gpu.yaml --profile training" compose -f docker-compose.yml -f compose.gpu.yaml \
    --profile training config -q
check "compose: + compose.npu.yaml --profile training" compose -f docker-compose.yml -f compose.npu.yaml \
    --profile training config -q
check "compose: refuses to run without RLHF_API_TOKEN" compose_needs_token
check "compose: + compose.environment.yaml (multi-turn episodes)" env RLHF_EXPERIMENT_CONFIG=./configs/demo.yaml \
    $DOCKER_COMPOSE -f docker-compose.yml -f compose.environment.yaml config -q
check "compose: + compose.gpu.yaml + compose.environment.yaml" env RLHF_EXPERIMENT_CONFIG=./configs/demo.yaml \
    $DOCKER_COMPOSE -f docker-compose.yml -f compose.gpu.yaml -f compose.environment.yaml config -q

echo "deploy-check: Helm chart ($("$HELM" version --short 2>/dev/null))"
check "helm lint --strict (default values)" "$HELM" lint --strict "$CHART"
check "helm lint --strict (values-gpu.yaml)" "$HELM" lint --strict "$CHART" "${GPU[@]}"
check "helm lint --strict (values-npu.yaml)" "$HELM" lint --strict "$CHART" "${NPU[@]}"
check "helm template | kubernetes-validate --strict (default)" validate
check "helm template | kubernetes-validate --strict (GPU)" validate "${GPU[@]}"
check "helm template | kubernetes-validate --strict (NPU)" validate "${NPU[@]}"
check "helm template | kubernetes-validate --strict (NPU, ascend.soc=a3)" validate "${NPU[@]}" --set ascend.soc=a3
check "helm template | kubernetes-validate --strict (NPU, hccl on hostNetwork)" validate "${NPU[@]}" \
    "${NPU_HCCL[@]}" "${NPU_HOSTNET[@]}"
check "helm template | kubernetes-validate --strict (NPU, hccl over RoCE)" validate "${NPU[@]}" \
    "${NPU_HCCL[@]}" --set ascend.roce.enabled=true
check "helm lint --strict (NPU, hccl on hostNetwork)" "$HELM" lint --strict "$CHART" "${NPU[@]}" \
    "${NPU_HCCL[@]}" "${NPU_HOSTNET[@]}"
check "ascend.soc=910b: -ascend-910b images, A2 nodes only" soc_render 910b
check "ascend.soc=a3: -ascend-a3 images, A3 nodes only" soc_render a3
check "refuses an unknown ascend.soc" refuses_saying "value must be one of '910b', 'a3'" "${NPU[@]}" \
    --set ascend.soc=a2
check "refuses an unknown ascend.soc (schema skipped: the template says it)" \
    refuses_saying "must be 910b (Atlas A2) or a3 (Atlas A3)" "${NPU[@]}" --set ascend.soc=a2 --skip-schema-validation
check "refuses hccl collective between pods without hostNetwork or RoCE" \
    refuses_saying "needs weightSync.hostNetwork=true or ascend.roce.enabled=true" "${NPU[@]}" "${NPU_HCCL[@]}"
check "helm template | kubernetes-validate (external Redis, TLS)" validate --set redis.enabled=false \
    --set redis.external.url=redis://:pw@redis.example:6379/0 --set tls.enabled=true --set tls.existingSecret=rlhf-tls
check "helm template | kubernetes-validate (external Sentinel, WAIT 1, KEDA)" validate --set redis.enabled=false \
    --set 'redis.external.sentinel.addresses={redis-node-0.redis-headless:26379}' \
    --set redis.external.passwordSecret.name=redis --set redis.external.waitReplicas=1 \
    --set rollout.autoscaling.keda.enabled=true
check "helm template | kubernetes-validate --strict (KEDA on rollout, reward, reference)" validate "${KEDA_ALL[@]}"
check "KEDA objects valid against KEDA's CRD schema (chart's Redis; rollout, reward, reference)" keda_valid \
    "${KEDA_ALL[@]}"
check "KEDA objects valid against KEDA's CRD schema (external Sentinel)" keda_valid "${KEDA_ALL[@]}" \
    --set redis.enabled=false --set 'redis.external.sentinel.addresses={redis-node-0.redis-headless:26379}' \
    --set redis.external.passwordSecret.name=redis
check "KEDA objects valid against KEDA's CRD schema (external Redis Cluster, TLS; GPU values)" keda_valid \
    "${GPU[@]}" "${KEDA_ALL[@]}" --set redis.enabled=false --set 'redis.external.cluster.addresses={redis-cluster:6379}' \
    --set redis.external.tls=true
check "the KEDA check refuses a misspelt ScaledObject field" keda_refuses 's/cooldownPeriod:/cooldownPeriods:/' \
    "${KEDA_ALL[@]}"
check "the KEDA check refuses a number where KEDA wants a string" keda_refuses \
    's/lagCount: "8"/lagCount: 8/' "${KEDA_ALL[@]}"
check "the KEDA check refuses an unknown trigger parameter" keda_refuses 's/threshold:/treshold:/' "${KEDA_ALL[@]}"
check "refuses reward/reference autoscaling without a Prometheus to query" \
    refuses_saying "needs autoscaling.prometheus.serverAddress" --set reward.autoscaling.keda.enabled=true
check "refuses a terminationGracePeriodSeconds shorter than the drain" \
    refuses_saying "is below the 70 s its pods need to drain" --set rollout.terminationGracePeriodSeconds=60
check "refuses a PodDisruptionBudget that no eviction can meet at the fewest replicas" \
    refuses_saying "no voluntary eviction could ever proceed" --set reference.autoscaling.keda.enabled=true \
    --set reference.autoscaling.keda.minReplicas=2 --set reference.pdb.minAvailable=2 --set serviceMonitor.enabled=true \
    --set autoscaling.prometheus.serverAddress=http://prometheus:9090
check "helm template | kubernetes-validate (external Redis Cluster, TLS)" validate --set redis.enabled=false \
    --set 'redis.external.cluster.addresses={redis-cluster:6379}' --set redis.external.tls=true
check "helm template | kubernetes-validate (GPU trainer, 2 nodes x 2 processes)" validate "${GPU[@]}" \
    --set trainer.torchrun.nnodes=2 --set trainer.torchrun.nprocPerNode=2 --set trainer.accelerator.count=2
check "helm template | kubernetes-validate (NPU trainer, 2 nodes x 2 processes)" validate "${NPU[@]}" \
    --set trainer.torchrun.nnodes=2 --set trainer.torchrun.nprocPerNode=2 --set trainer.accelerator.count=2
check "helm lint --strict (environment service on)" "$HELM" lint --strict "$CHART" \
    --set experiment.config.environment.name=builtin:calculator
check "helm template | kubernetes-validate --strict (environment service, 2 replicas; GPU values)" validate \
    -f k8s/examples/values-gpu.yaml --set experiment.config.environment.name=builtin:calculator \
    --set environment.replicas=2
check "helm template | kubernetes-validate --strict (weightSync.delta=auto)" validate --set weightSync.delta=auto
check "refuses environment.enabled=true without the config's environment.name" \
    refuses_saying "sets no environment.name" --set environment.enabled=true
check "helm lint --strict (training service on)" "$HELM" lint --strict "$CHART" --set training.enabled=true \
    --set training.auth.existingSecret=rlhf-training-tokens
check "helm template | kubernetes-validate --strict (training service on GPU; GPU values)" validate "${GPU[@]}" \
    --set training.enabled=true --set training.auth.existingSecret=rlhf-training-tokens \
    --set training.accelerator.type=nvidia
check "refuses training.enabled without the users' keys Secret" \
    refuses_saying "needs training.auth.existingSecret" --set training.enabled=true
check "values.schema.json rejects trainer.kind (the trainer is always a Job)" refuses --set trainer.kind=StatefulSet
check "values.schema.json rejects a misspelt key" refuses --set rollout.acelerator.type=nvidia
check "values.schema.json rejects an unknown accelerator" refuses --set trainer.accelerator.type=tpu

echo "deploy-check: yamllint"
check "yamllint (compose files, chart values, examples, configs)" "$TOOLS_BIN/yamllint" --strict \
    docker-compose.yml compose.gpu.yaml compose.npu.yaml compose.npu-hccl.yaml compose.environment.yaml .yamllint k8s \
    configs/llama32-1b-ppo.yaml configs/llama32-1b-online-dpo.yaml

echo "deploy-check: tests/deploy"
# shellcheck disable=SC2086
check "pytest tests/deploy" env HELM="$HELM" DOCKER_COMPOSE="$DOCKER_COMPOSE" "$PY" -m pytest -q tests/deploy ${PYTEST_ARGS:-}
tail -n 1 "$log" | sed 's/^/        /'  # pytest's summary line

total=$(fmt_ds $(($(now_ds) - start_all)))
if [ ${#failed[@]} -eq 0 ]; then
    echo "deploy-check: all $count checks ok in $total"
else
    echo "deploy-check: ${#failed[@]} of $count checks FAILED in $total: $(IFS=,; echo "${failed[*]}")"
    exit 1
fi
