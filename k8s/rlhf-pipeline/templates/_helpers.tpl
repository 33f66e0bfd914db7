{{/* ------------------------------------------------------------------ names and labels */}}

{{- define "rlhf.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rlhf.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component>"; call with (dict "root" $ "component" "rollout") */}}
{{- define "rlhf.componentName" -}}
{{- printf "%s-%s" (include "rlhf.fullname" .root | trunc 50 | trimSuffix "-") .component }}
{{- end }}

{{- define "rlhf.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* labels; call with (dict "root" $ "component" "rollout") */}}
{{- define "rlhf.labels" -}}
helm.sh/chart: {{ include "rlhf.chart" .root }}
{{ include "rlhf.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: rlhf-pipeline
{{- end }}

{{- define "rlhf.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rlhf.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "rlhf.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rlhf.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* ------------------------------------------------------------------ experiment, run id, addresses */}}

{{/* The experiment config as YAML text: experiment.configYaml (e.g. --set-file) wins over experiment.config. */}}
{{- define "rlhf.experimentYaml" -}}
{{- if .Values.experiment.configYaml }}
{{- .Values.experiment.configYaml }}
{{- else }}
{{- toYaml .Values.experiment.config }}
{{- end }}
{{- end }}

{{- define "rlhf.configMapName" -}}
{{- default (printf "%s-experiment" (include "rlhf.fullname" .)) .Values.experiment.existingConfigMap }}
{{- end }}

{{/* experiment.runId, else the config's run_id, else "default" (the config's own default). */}}
{{- define "rlhf.runId" -}}
{{- if .Values.experiment.runId }}
{{- .Values.experiment.runId }}
{{- else if .Values.experiment.existingConfigMap }}
{{- "default" }}
{{- else }}
{{- $cfg := include "rlhf.experimentYaml" . | fromYaml }}
{{- default "default" (get $cfg "run_id") }}
{{- end }}
{{- end }}

{{- define "rlhf.svcDomain" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{- define "rlhf.grpcAddr" -}}
{{- printf "%s.%s:%v" (include "rlhf.componentName" (dict "root" .root "component" .component)) (include "rlhf.svcDomain" .root) .root.Values.ports.grpc }}
{{- end }}

{{/* Every rollout replica: the headless Service resolves to all ready pods (the trainer pushes weights to each). */}}
{{- define "rlhf.rolloutAddrs" -}}
{{- printf "%s-headless.%s:%v" (include "rlhf.componentName" (dict "root" . "component" "rollout")) (include "rlhf.svcDomain" .) .Values.ports.grpc }}
{{- end }}

{{/* The experiment config's environment section as a dict (empty with experiment.existingConfigMap: not readable) */}}
{{- define "rlhf.configEnvironment" -}}
{{- $env := dict }}
{{- if not .Values.experiment.existingConfigMap }}
{{- $cfg := include "rlhf.experimentYaml" . | fromYaml }}
{{- $section := get $cfg "environment" }}
{{- if kindIs "map" $section }}{{ $env = $section }}{{ end }}
{{- end }}
{{- toYaml $env }}
{{- end }}

{{/* "true" when the environment service is deployed: environment.enabled, or (null) the config's environment.name.
     Fails on values that would deploy it for nothing or leave the config's episodes without a service. */}}
{{- define "rlhf.environmentEnabled" -}}
{{- $on := .Values.environment.enabled }}
{{- $name := default "" (get (include "rlhf.configEnvironment" . | fromYaml) "name") }}
{{- /* rollout.env naming a service of the user's own: the rollout would never call the chart's */}}
{{- $own := include "rlhf.envHas" (dict "env" .Values.rollout.env "name" "RLHF_ENVIRONMENT_ADDR") }}
{{- if kindIs "invalid" $on }}
{{- if and $name (not $own) }}true{{ end }}
{{- else if $on }}
{{- if and (not $name) (not .Values.experiment.existingConfigMap) }}
{{- fail "environment.enabled=true, but the experiment config sets no environment.name: the environment service would host nothing. Set environment.name in the config (docs/environments.md) or leave environment.enabled unset" }}
{{- end }}
{{- if $own }}
{{- fail "environment.enabled=true, but rollout.env sets RLHF_ENVIRONMENT_ADDR: the rollout would never call the chart's environment service. Drop one of them" }}
{{- end }}
{{- print "true" }}
{{- else if and $name (not $own) }}
{{- fail (printf "environment.enabled=false, but the experiment config's environment.name is %s: its episodes need an environment service. Leave environment.enabled unset (or true), or give rollout.env an RLHF_ENVIRONMENT_ADDR of your own service" $name) }}
{{- end }}
{{- end }}

{{/* environment.replicas, else the config's environment.replicas (what `rlhf up` starts), else 1 */}}
{{- define "rlhf.environmentReplicas" -}}
{{- $n := .Values.environment.replicas }}
{{- if kindIs "invalid" $n }}
{{- $n = default 1 (get (include "rlhf.configEnvironment" . | fromYaml) "replicas") }}
{{- end }}
{{- int $n }}
{{- end }}

{{/* "true" when a component is deployed; (dict "root" $ "component" NAME) */}}
{{- define "rlhf.componentEnabled" -}}
{{- if eq .component "environment" }}
{{- include "rlhf.environmentEnabled" .root }}
{{- else if (index .root.Values .component).enabled }}true{{ end }}
{{- end }}

{{/* ------------------------------------------------------------------ secrets */}}

{{- define "rlhf.secretName" -}}
{{- printf "%s-secrets" (include "rlhf.fullname" .) }}
{{- end }}

{{- define "rlhf.apiTokenSecret" -}}
{{- default (include "rlhf.secretName" .) .Values.auth.existingSecret }}
{{- end }}

{{- define "rlhf.redisHost" -}}
{{- printf "%s.%s" (include "rlhf.componentName" (dict "root" . "component" "redis")) (include "rlhf.svcDomain" .) }}
{{- end }}

{{- define "rlhf.redisPasswordSecret" -}}
{{- default (include "rlhf.secretName" .) .Values.redis.auth.existingSecret }}
{{- end }}

{{- define "rlhf.redisUrlSecret" -}}
{{- default (include "rlhf.secretName" .) .Values.redis.external.existingSecret }}
{{- end }}

{{/* How the services reach Redis: "chart" (the chart's own), "url" (an external URL in a Secret), "sentinel" or
"cluster" (external, RLHF_REDIS_URL built from redis.external). Fails on values that would be ignored. */}}
{{- define "rlhf.redisMode" -}}
{{- $r := .Values.redis }}
{{- $ext := $r.external }}
{{- $given := list }}
{{- if or $ext.url $ext.existingSecret }}{{ $given = append $given "url" }}{{ end }}
{{- if $ext.sentinel.addresses }}{{ $given = append $given "sentinel" }}{{ end }}
{{- if $ext.cluster.addresses }}{{ $given = append $given "cluster" }}{{ end }}
{{- $ha := or $ext.sentinel.addresses $ext.cluster.addresses }}
{{- if $r.enabled }}
{{- if or $ha (gt (int $ext.waitReplicas) 0) }}
{{- fail "redis.external.sentinel / .cluster / .waitReplicas apply with redis.enabled=false (the chart's own Redis has no replicas)" }}
{{- end }}
{{- print "chart" }}
{{- else }}
{{- if eq (len $given) 0 }}
{{- fail "redis.enabled=false needs redis.external.url or redis.external.existingSecret (a Secret with the redis:// URL), redis.external.sentinel.addresses or redis.external.cluster.addresses" }}
{{- end }}
{{- if gt (len $given) 1 }}
{{- fail (printf "redis.external: set one of url/existingSecret, sentinel.addresses, cluster.addresses (got %s)" (join ", " $given)) }}
{{- end }}
{{- $mode := first $given }}
{{- if and (gt (int $ext.waitReplicas) 0) (eq $mode "url") }}
{{- fail "redis.external.waitReplicas: with redis.external.url put wait_replicas=N in the URL's query instead" }}
{{- end }}
{{- if and (gt (int $ext.waitReplicas) 0) (eq $mode "cluster") }}
{{- fail "redis.external.waitReplicas is not available on a Redis Cluster (WAIT must go on the connection that wrote; redis-py's cluster client cannot do that): use a Sentinel group for acknowledged replication" }}
{{- end }}
{{- print $mode }}
{{- end }}
{{- end }}

{{/* RLHF_REDIS_URL of an external Sentinel group or cluster; $(REDIS_PASSWORD) is expanded by Kubernetes. */}}
{{- define "rlhf.redisHaUrl" -}}
{{- $ext := .Values.redis.external }}
{{- $auth := ternary ":$(REDIS_PASSWORD)@" "" (ne $ext.passwordSecret.name "") }}
{{- $scheme := ternary "rediss" "redis" $ext.tls }}
{{- if $ext.sentinel.addresses }}
{{- $q := "" }}
{{- if gt (int $ext.waitReplicas) 0 }}
{{- $q = printf "?wait_replicas=%d&wait_timeout_ms=%d" (int $ext.waitReplicas) (int $ext.waitTimeoutMs) }}
{{- end }}
{{- printf "%s+sentinel://%s%s/%s/0%s" $scheme $auth (join "," $ext.sentinel.addresses) $ext.sentinel.serviceName $q }}
{{- else }}
{{- printf "%s+cluster://%s%s" $scheme $auth (join "," $ext.cluster.addresses) }}
{{- end }}
{{- end }}

{{/* A secret value kept across upgrades: the given one, else the one already in the cluster, else a new random one. */}}
{{- define "rlhf.secretValue" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace (include "rlhf.secretName" .root) }}
{{- $old := "" }}
{{- if $existing }}
{{- $old = dig "data" .key "" $existing | b64dec }}
{{- end }}
{{- .value | default $old | default (randAlphaNum 32) }}
{{- end }}

{{/* ------------------------------------------------------------------ images and devices */}}

{{/* accelerator.type -> the image flavour and RLHF_DEVICE */}}
{{- define "rlhf.imageFlavour" -}}
{{- get (dict "none" "cpu" "nvidia" "cuda" "ascend" "ascend") .accelerator.type }}
{{- end }}

{{- define "rlhf.device" -}}
{{- get (dict "none" "cpu" "nvidia" "cuda" "ascend" "npu") .accelerator.type }}
{{- end }}

{{- define "rlhf.acceleratorResource" -}}
{{- if .accelerator.resourceName }}
{{- .accelerator.resourceName }}
{{- else }}
{{- get (dict "nvidia" "nvidia.com/gpu" "ascend" "huawei.com/Ascend910") .accelerator.type }}
{{- end }}
{{- end }}

{{/* ascend.soc, checked (the schema checks it too; this also holds under --skip-schema-validation) */}}
{{- define "rlhf.ascendSoc" -}}
{{- $soc := toString .Values.ascend.soc }}
{{- if not (has $soc (list "910b" "a3")) }}
{{- fail (printf "ascend.soc=%s: must be 910b (Atlas A2) or a3 (Atlas A3): the Ascend images are built per SoC (docker/Dockerfile --build-arg ASCEND_SOC) and run on that generation only" $soc) }}
{{- end }}
{{- $soc }}
{{- end }}

{{/* image reference; call with (dict "root" $ "values" .Values.rollout) */}}
{{- define "rlhf.image" -}}
{{- $img := .values.image }}
{{- $registry := .root.Values.image.registry }}
{{- $repo := ternary $img.repository (printf "%s/%s" $registry $img.repository) (empty $registry) }}
{{- $flavour := include "rlhf.imageFlavour" .values }}
{{- if eq $flavour "ascend" }}
{{- $flavour = printf "ascend-%s" (include "rlhf.ascendSoc" .root) }}
{{- end }}
{{- $tag := $img.tag | default .root.Values.image.tag | default (printf "%s-%s" .root.Chart.AppVersion $flavour) }}
{{- if $img.digest }}
{{- printf "%s@%s" $repo $img.digest }}
{{- else }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}
{{- end }}

{{/* resources with the accelerator added to requests and limits */}}
{{- define "rlhf.resources" -}}
{{- $res := deepCopy (default (dict) .resources) }}
{{- if ne .accelerator.type "none" }}
{{- $name := include "rlhf.acceleratorResource" . }}
{{- $_ := set $res "requests" (merge (dict $name (toString .accelerator.count)) (default (dict) $res.requests)) }}
{{- $_ := set $res "limits" (merge (dict $name (toString .accelerator.count)) (default (dict) $res.limits)) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* ------------------------------------------------------------------ pod pieces shared by the services */}}

{{- define "rlhf.probe" -}}
{{- $p := .probe }}
httpGet:
  path: {{ $p.path }}
  port: http
  scheme: {{ ternary "HTTPS" "HTTP" .root.Values.tls.enabled }}
{{- with $p.initialDelaySeconds }}
initialDelaySeconds: {{ . }}
{{- end }}
periodSeconds: {{ $p.periodSeconds }}
timeoutSeconds: {{ $p.timeoutSeconds }}
failureThreshold: {{ $p.failureThreshold }}
{{- end }}

{{- define "rlhf.probes" -}}
{{- $root := .root }}
{{- with .values.probes }}
{{- if .startup.enabled }}
startupProbe:
  {{- include "rlhf.probe" (dict "root" $root "probe" .startup) | trim | nindent 2 }}
{{- end }}
{{- if .liveness.enabled }}
livenessProbe:
  {{- include "rlhf.probe" (dict "root" $root "probe" .liveness) | trim | nindent 2 }}
{{- end }}
{{- if .readiness.enabled }}
readinessProbe:
  {{- include "rlhf.probe" (dict "root" $root "probe" .readiness) | trim | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}

{{/* OMP_NUM_THREADS of a container: its CPU limit, else its CPU request, in whole cores (at least 1). torch sizes its
thread pool by the node's cores otherwise, and several pods on one node oversubscribe it. */}}
{{- define "rlhf.ompThreads" -}}
{{- $res := default (dict) . }}
{{- $cpu := toString (or (dig "limits" "cpu" "" $res) (dig "requests" "cpu" "" $res) "1") }}
{{- $n := 1 }}
{{- if hasSuffix "m" $cpu }}
{{- $n = div (atoi (trimSuffix "m" $cpu)) 1000 }}
{{- else }}
{{- $n = int (floor (float64 $cpu)) }}
{{- end }}
{{- max 1 $n }}
{{- end }}

{{/* "true" when the EnvVar list .env sets .name (the user's own value wins over the chart's) */}}
{{- define "rlhf.envHas" -}}
{{- range .env }}{{ if eq .name $.name }}true{{ end }}{{ end }}
{{- end }}

{{/* RLHF_* environment of a service container; call with (dict "root" $ "component" "rollout" "values" .Values.rollout) */}}
{{- define "rlhf.env" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
- name: RLHF_HOST
  value: "0.0.0.0"
- name: RLHF_GRPC_PORT
  value: {{ include "rlhf.listenPort" (dict "root" $root "component" .component "port" "grpc") | quote }}
- name: RLHF_HTTP_PORT
  value: {{ include "rlhf.listenPort" (dict "root" $root "component" .component "port" "http") | quote }}
- name: RLHF_CONFIG
  value: /etc/rlhf/config.yaml
- name: RLHF_RUN_ID
  value: {{ include "rlhf.runId" $root | quote }}
- name: RLHF_DEVICE
  value: {{ include "rlhf.device" .values | quote }}
- name: RLHF_LOG_LEVEL
  value: {{ $v.settings.logLevel | quote }}
- name: RLHF_MAX_MESSAGE_BYTES
  value: {{ $v.settings.maxMessageBytes | int64 | quote }}
- name: RLHF_MAX_BODY_BYTES
  value: {{ $v.settings.maxBodyBytes | int64 | quote }}
- name: RLHF_SHUTDOWN_GRACE_S
  value: {{ $v.settings.shutdownGraceSeconds | quote }}
{{- if and (has .component (list "reward" "reference")) (not (kindIs "invalid" $v.settings.grpcMaxConnectionAgeSeconds)) }}
- name: RLHF_GRPC_MAX_CONNECTION_AGE_S
  value: {{ $v.settings.grpcMaxConnectionAgeSeconds | quote }}
{{- end }}
- name: RLHF_CACHE_DIR
  value: /var/cache/rlhf
- name: HF_HUB_OFFLINE
  value: {{ ternary "1" "0" $v.settings.hfHubOffline | quote }}
{{- if not (include "rlhf.envHas" (dict "env" .values.env "name" "OMP_NUM_THREADS")) }}
- name: OMP_NUM_THREADS
  value: {{ include "rlhf.ompThreads" .values.resources | quote }}
{{- end }}
{{- if and (include "rlhf.onHostNetwork" .) (eq .values.accelerator.type "ascend") (not (include "rlhf.envHas" (dict "env" .values.env "name" "HCCL_HOST_SOCKET_PORT_RANGE"))) }}
{{- /* on the node's network the trainer and a rollout pod share one port space: HCCL's host sockets would both take
     its default range (60000-60015, by device index, 0 in each pod); let the OS assign them */}}
- name: HCCL_HOST_SOCKET_PORT_RANGE
  value: auto
{{- end }}
- name: RLHF_REPLICA_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: RLHF_API_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "rlhf.apiTokenSecret" $root }}
      key: {{ $v.auth.existingSecretKey }}
{{- if $v.tls.enabled }}
- name: RLHF_TLS_CERT
  value: /etc/rlhf-tls/tls.crt
- name: RLHF_TLS_KEY
  value: /etc/rlhf-tls/tls.key
{{- if or (eq .component "rollout") (eq .component "trainer") }}
- name: RLHF_TLS_CA
  value: {{ printf "/etc/rlhf-tls/%s" $v.tls.caKey | quote }}
{{- end }}
{{- end }}
{{- if or (eq .component "rollout") (eq .component "trainer") }}
{{- if $v.redis.enabled }}
{{- if $v.redis.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "rlhf.redisPasswordSecret" $root }}
      key: {{ $v.redis.auth.existingSecretPasswordKey }}
- name: RLHF_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "rlhf.redisHost" $root) | quote }}
{{- else }}
- name: RLHF_REDIS_URL
  value: {{ printf "redis://%s:6379/0" (include "rlhf.redisHost" $root) | quote }}
{{- end }}
{{- else if has (include "rlhf.redisMode" $root) (list "sentinel" "cluster") }}
{{- if $v.redis.external.passwordSecret.name }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $v.redis.external.passwordSecret.name }}
      key: {{ $v.redis.external.passwordSecret.key }}
{{- end }}
- name: RLHF_REDIS_URL
  value: {{ include "rlhf.redisHaUrl" $root | quote }}
{{- else }}
- name: RLHF_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "rlhf.redisUrlSecret" $root }}
      key: {{ $v.redis.external.existingSecretUrlKey }}
{{- end }}
- name: RLHF_REWARD_ADDR
  value: {{ include "rlhf.grpcAddr" (dict "root" $root "component" "reward") | quote }}
- name: RLHF_REFERENCE_ADDR
  value: {{ include "rlhf.grpcAddr" (dict "root" $root "component" "reference") | quote }}
{{- end }}
{{- if and (eq .component "rollout") (include "rlhf.environmentEnabled" $root) }}
{{- /* the ClusterIP Service: each replica's one gRPC connection goes to one pod (kube-proxy balances connections),
     so an episode's calls reach the pod that holds it */}}
- name: RLHF_ENVIRONMENT_ADDR
  value: {{ include "rlhf.grpcAddr" (dict "root" $root "component" "environment") | quote }}
{{- end }}
{{- if eq .component "trainer" }}
- name: RLHF_ROLLOUT_ADDRS
  value: {{ include "rlhf.rolloutAddrs" $root | quote }}
{{- end }}
{{- if eq .component "trainer" }}
{{- include "rlhf.weightSyncEnv" $root }}
{{- end }}
{{- if and (eq .component "rollout") $v.ports.weightsData (not $v.tls.enabled) }}
- name: RLHF_WEIGHTS_DATA_PORT
  value: {{ $v.ports.weightsData | quote }}
{{- end }}
{{- if and (eq .component "rollout") .values.engine }}
- name: RLHF_ROLLOUT_ENGINE
  value: {{ .values.engine | quote }}
{{- end }}
{{- if eq .component "training" }}
- name: RLHF_TRAINING_TOKENS
  valueFrom:
    secretKeyRef:
      name: {{ $v.training.auth.existingSecret }}
      key: {{ $v.training.auth.existingSecretKey }}
{{- end }}
{{- with .values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* volumeMounts of a service container */}}
{{- define "rlhf.volumeMounts" -}}
{{- $v := .root.Values }}
- name: experiment
  mountPath: /etc/rlhf
  readOnly: true
- name: cache
  mountPath: /var/cache/rlhf
- name: tmp
  mountPath: /tmp
- name: shm
  mountPath: /dev/shm
{{- if $v.tls.enabled }}
- name: tls
  mountPath: /etc/rlhf-tls
  readOnly: true
{{- end }}
{{- if and (eq .values.accelerator.type "ascend") $v.ascend.driverHostPaths.enabled }}
{{- range $i, $path := $v.ascend.driverHostPaths.paths }}
- name: ascend-driver-{{ $i }}
  mountPath: {{ $path }}
  readOnly: true
{{- end }}
{{- end }}
{{- if and (eq .values.accelerator.type "ascend") $v.ascend.roce.enabled }}
- name: hccn-conf
  mountPath: {{ $v.ascend.roce.hccnConfPath }}
  readOnly: true
{{- end }}
{{- if eq .component "training" }}
- name: checkpoints
  mountPath: {{ $v.training.checkpoints.mountPath }}
{{- end }}
{{- with $v.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* volumes of a service pod */}}
{{- define "rlhf.volumes" -}}
{{- $v := .root.Values }}
- name: experiment
  configMap:
    name: {{ include "rlhf.configMapName" .root }}
    items:
      - key: config.yaml
        path: config.yaml
- name: cache
  emptyDir: {}
- name: tmp
  emptyDir: {}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .values.shmSize }}
{{- if $v.tls.enabled }}
- name: tls
  secret:
    secretName: {{ $v.tls.existingSecret }}
{{- end }}
{{- if and (eq .values.accelerator.type "ascend") $v.ascend.driverHostPaths.enabled }}
{{- range $i, $path := $v.ascend.driverHostPaths.paths }}
- name: ascend-driver-{{ $i }}
  hostPath:
    path: {{ $path }}
{{- end }}
{{- end }}
{{- if and (eq .values.accelerator.type "ascend") $v.ascend.roce.enabled }}
- name: hccn-conf
  hostPath:
    path: {{ $v.ascend.roce.hccnConfPath }}
    type: File
{{- end }}
{{- if eq .component "training" }}
{{- $p := $v.training.checkpoints.persistence }}
- name: checkpoints
  {{- if $p.enabled }}
  persistentVolumeClaim:
    claimName: {{ $p.existingClaim | default (printf "%s-checkpoints" (include "rlhf.componentName" (dict "root" .root "component" "training"))) }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}
{{- with $v.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Rollout, reward and reference: the components KEDA may scale in, whose pods drain before they stop. */}}
{{- define "rlhf.drains" -}}
{{- if has . (list "rollout" "reward" "reference") }}true{{ end }}
{{- end }}

{{/* Seconds a draining component needs after SIGTERM (rlhf/serving/runner.py _graceful_stop): the gRPC server's
stop(grace) beside the HTTP server's wait (grace + 5); a rollout replica's worker then gets drain_s = grace for its jobs
in flight, bounded at grace + 10 (services/rollout/worker.py aclose). ctx: root, component */}}
{{- define "rlhf.drainSeconds" -}}
{{- $grace := .root.Values.settings.shutdownGraceSeconds | float64 | ceil | int }}
{{- $drain := add $grace 5 }}
{{- if eq .component "rollout" }}{{ $drain = add $drain $grace 10 }}{{ end }}
{{- $drain }}
{{- end }}

{{/* terminationGracePeriodSeconds: the value, else (draining components) preStop + drain + 10 s for the engine's
close and the exit; a value below that fails the render (SIGKILL would cut the drain). ctx: root, component, values */}}
{{- define "rlhf.terminationGrace" -}}
{{- $set := .values.terminationGracePeriodSeconds }}
{{- if include "rlhf.drains" .component }}
{{- $need := add .root.Values.settings.preStopSeconds (include "rlhf.drainSeconds" . | int) 10 }}
{{- if kindIs "invalid" $set }}{{ $need }}
{{- else if lt (int $set) (int $need) }}
{{- fail (printf "%s.terminationGracePeriodSeconds %d is below the %d s its pods need to drain (settings.preStopSeconds %d + the drain after SIGTERM, from settings.shutdownGraceSeconds, + 10): leave it null or raise it" .component (int $set) (int $need) (int .root.Values.settings.preStopSeconds)) }}
{{- else }}{{ $set }}{{ end }}
{{- else }}{{ $set }}{{ end }}
{{- end }}

{{/* pod spec fields shared by every service pod (scheduling, security, pull secrets) */}}
{{- define "rlhf.podCommon" -}}
{{- $v := .root.Values }}
{{- include "rlhf.hostNetworkGuard" .root }}
serviceAccountName: {{ include "rlhf.serviceAccountName" .root }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- if include "rlhf.onHostNetwork" . }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- with $v.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
terminationGracePeriodSeconds: {{ include "rlhf.terminationGrace" . }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with include "rlhf.affinity" . | trim }}
affinity:
  {{- . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The component's affinity: its own, plus (accelerator.type ascend, ascend.nodeAffinity.enabled) a required
     `<key> In <values of ascend.soc>` in each of its required node-selector terms, plus, when the rollout must share
     the trainer's node (rlhf.colocateRollout), a required pod affinity of the rollout to the trainer's pods and a
     preferred one of the trainer to the rollout's. */}}
{{- define "rlhf.affinity" -}}
{{- $v := .root.Values }}
{{- $aff := deepCopy (default (dict) .values.affinity) }}
{{- if and (eq .values.accelerator.type "ascend") $v.ascend.nodeAffinity.enabled }}
{{- $soc := include "rlhf.ascendSoc" .root }}
{{- $types := index $v.ascend.nodeAffinity.values $soc }}
{{- if not $types }}
{{- fail (printf "ascend.nodeAffinity.values.%s is empty: list the %s label values of %s nodes" $soc $v.ascend.nodeAffinity.key $soc) }}
{{- end }}
{{- $expr := dict "key" $v.ascend.nodeAffinity.key "operator" "In" "values" $types }}
{{- $node := default (dict) (get $aff "nodeAffinity") }}
{{- $req := default (dict) (get $node "requiredDuringSchedulingIgnoredDuringExecution") }}
{{- $terms := list }}
{{- range (default (list) (get $req "nodeSelectorTerms")) }}
{{- $term := deepCopy . }}
{{- $_ := set $term "matchExpressions" (append (default (list) (get $term "matchExpressions")) $expr) }}
{{- $terms = append $terms $term }}
{{- end }}
{{- if not $terms }}
{{- $terms = list (dict "matchExpressions" (list $expr)) }}
{{- end }}
{{- $_ := set $req "nodeSelectorTerms" $terms }}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $req }}
{{- $_ := set $aff "nodeAffinity" $node }}
{{- end }}
{{- if and (eq .component "rollout") (include "rlhf.colocateRollout" .root) }}
{{- $trainer := include "rlhf.selectorLabels" (dict "root" .root "component" "trainer") | fromYaml }}
{{- $term := dict "labelSelector" (dict "matchLabels" $trainer) "topologyKey" "kubernetes.io/hostname" }}
{{- $pod := default (dict) (get $aff "podAffinity") }}
{{- $_ := set $pod "requiredDuringSchedulingIgnoredDuringExecution" (append (default (list) (get $pod "requiredDuringSchedulingIgnoredDuringExecution")) $term) }}
{{- $_ := set $aff "podAffinity" $pod }}
{{- end }}
{{- if and (eq .component "trainer") (include "rlhf.colocateRollout" .root) }}
{{- /* a replaced trainer pod goes back to the rollout's node (required both ways would deadlock the first placement) */}}
{{- $rollout := include "rlhf.selectorLabels" (dict "root" .root "component" "rollout") | fromYaml }}
{{- $term := dict "weight" 100 "podAffinityTerm" (dict "labelSelector" (dict "matchLabels" $rollout) "topologyKey" "kubernetes.io/hostname") }}
{{- $pod := default (dict) (get $aff "podAffinity") }}
{{- $_ := set $pod "preferredDuringSchedulingIgnoredDuringExecution" (append (default (list) (get $pod "preferredDuringSchedulingIgnoredDuringExecution")) $term) }}
{{- $_ := set $aff "podAffinity" $pod }}
{{- end }}
{{- if $aff }}
{{- toYaml $aff }}
{{- end }}
{{- end }}

{{/* ------------------------------------------------------------------ host network (HCCL between pods of one node) */}}

{{/* "true" when the trainer pushes weights by a collective over hccl: weightSync.collectiveBackend hccl, or auto
     with an Ascend trainer (the trainer picks by its device) */}}
{{- define "rlhf.hcclCollective" -}}
{{- $w := .Values.weightSync }}
{{- if eq $w.transport "collective" }}
{{- if or (eq $w.collectiveBackend "hccl") (and (eq $w.collectiveBackend "auto") (eq .Values.trainer.accelerator.type "ascend")) }}true{{ end }}
{{- end }}
{{- end }}

{{/* "true" for the trainer and rollout pods with weightSync.hostNetwork; (dict "root" $ "component" NAME) */}}
{{- define "rlhf.onHostNetwork" -}}
{{- if and .root.Values.weightSync.hostNetwork (has .component (list "rollout" "trainer")) }}true{{ end }}
{{- end }}

{{/* "true" when each rollout pod must run on the trainer's node: hccl collective on the node's network without a
     RoCE fabric (HCCL reaches another node's NPUs over RoCE only) */}}
{{- define "rlhf.colocateRollout" -}}
{{- if and .Values.weightSync.hostNetwork (include "rlhf.hcclCollective" .) (not .Values.ascend.roce.enabled) }}true{{ end }}
{{- end }}

{{/* The gRPC or HTTP port a component listens on: ports.*, except the trainer's on the node's network
     (trainer.hostNetworkPorts); (dict "root" $ "component" NAME "port" "grpc"|"http") */}}
{{- define "rlhf.listenPort" -}}
{{- if and (eq .component "trainer") (include "rlhf.onHostNetwork" .) }}
{{- index .root.Values.trainer.hostNetworkPorts .port | int }}
{{- else }}
{{- index .root.Values.ports .port | int }}
{{- end }}
{{- end }}

{{/* Values the HCCL / host-network settings refuse; renders nothing. */}}
{{- define "rlhf.hostNetworkGuard" -}}
{{- $v := .Values }}
{{- if and (include "rlhf.hcclCollective" .) (not $v.weightSync.hostNetwork) (not $v.ascend.roce.enabled) }}
{{- fail "weightSync.transport=collective over hccl needs weightSync.hostNetwork=true or ascend.roce.enabled=true: HCCL takes two pods with their own IPs for two servers, even on one node, and then needs RoCE links between their NPUs (vllm-ascend#14506). Put trainer and rollout on the node's network (weightSync.hostNetwork=true), declare a configured RoCE fabric with /etc/hccn.conf on the nodes (ascend.roce.enabled=true), or push over TCP (weightSync.transport=tcp)" }}
{{- end }}
{{- if include "rlhf.colocateRollout" . }}
{{- if or (ne (int $v.rollout.replicas) 1) $v.rollout.autoscaling.keda.enabled }}
{{- fail (printf "weightSync.hostNetwork with collective over hccl and no RoCE fabric: each rollout pod must share the trainer's node (HCCS) and its pods use the node's ports, so one fits: set rollout.replicas=1 and no KEDA (got replicas %d, keda %v), or ascend.roce.enabled=true where the NPUs' RoCE fabric is configured, or weightSync.transport=tcp" (int $v.rollout.replicas) $v.rollout.autoscaling.keda.enabled) }}
{{- end }}
{{- end }}
{{- if $v.weightSync.hostNetwork }}
{{- if and $v.networkPolicy.enabled (not $v.networkPolicy.nodesFrom) }}
{{- fail "weightSync.hostNetwork: the trainer and rollout pods reach reward, reference and Redis from their node's address, which the NetworkPolicies' podSelectors do not match: list the nodes in networkPolicy.nodesFrom (e.g. [{ipBlock: {cidr: <node CIDR>}}]) or set networkPolicy.enabled=false" }}
{{- end }}
{{- $tp := $v.trainer.hostNetworkPorts }}
{{- $taken := list (int $v.ports.grpc) (int $v.ports.http) }}
{{- if $v.ports.weightsData }}{{ $taken = append $taken (int $v.ports.weightsData) }}{{ end }}
{{- if or (has (int $tp.grpc) $taken) (has (int $tp.http) $taken) (eq (int $tp.grpc) (int $tp.http)) }}
{{- fail (printf "weightSync.hostNetwork: trainer.hostNetworkPorts (grpc %d, http %d) must differ from each other and from the rollout's ports on the same node (ports.grpc %d, ports.http %d, ports.weightsData %d)" (int $tp.grpc) (int $tp.http) (int $v.ports.grpc) (int $v.ports.http) (int $v.ports.weightsData)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* annotations that roll the pods when the experiment config changes */}}
{{- define "rlhf.podAnnotations" -}}
{{- if not .root.Values.experiment.existingConfigMap }}
checksum/experiment: {{ include "rlhf.experimentYaml" .root | sha256sum }}
{{- end }}
{{- with .values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* ------------------------------------------------------------------ the stateless services */}}

{{/* Deployment of rollout, reward, reference or environment; (dict "root" $ "component" NAME) */}}
{{- define "rlhf.deployment" -}}
{{- $root := .root }}
{{- $component := .component }}
{{- $values := index $root.Values $component }}
{{- if eq $component "environment" }}
{{- /* torch-free text tasks: no accelerator value, the CPU image and RLHF_DEVICE=cpu */}}
{{- $values = merge (dict "accelerator" (dict "type" "none" "count" 1)) $values }}
{{- end }}
{{- $ctx := dict "root" $root "component" $component "values" $values }}
{{- $name := include "rlhf.componentName" $ctx }}
{{- $keda := and (include "rlhf.drains" $component) $values.autoscaling.keda.enabled }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "rlhf.labels" $ctx | trim | nindent 4 }}
spec:
  {{- if eq $component "environment" }}
  replicas: {{ include "rlhf.environmentReplicas" $root }}
  {{- else if eq $component "training" }}
  replicas: 1  # sessions, runs and futures live in the one process's memory
  {{- else if not $keda }}
  replicas: {{ $values.replicas }}
  {{- end }}
  revisionHistoryLimit: 3
  {{- with $values.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "rlhf.selectorLabels" $ctx | trim | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "rlhf.selectorLabels" $ctx | trim | nindent 8 }}
        {{- with $values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with include "rlhf.podAnnotations" $ctx | trim }}
      annotations:
        {{- . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "rlhf.podCommon" $ctx | trim | nindent 6 }}
      containers:
        - name: {{ $component }}
          image: {{ include "rlhf.image" $ctx | quote }}
          imagePullPolicy: {{ $values.image.pullPolicy | default $root.Values.image.pullPolicy }}
          args:
            - rlhf
            - serve
            - {{ $component }}
            - --config
            - /etc/rlhf/config.yaml
            - --grpc-port
            - {{ $root.Values.ports.grpc | quote }}
            - --http-port
            - {{ $root.Values.ports.http | quote }}
          ports:
            - name: grpc
              containerPort: {{ $root.Values.ports.grpc }}
              protocol: TCP
            - name: http
              containerPort: {{ $root.Values.ports.http }}
              protocol: TCP
            {{- if and (eq $component "rollout") $root.Values.ports.weightsData (not $root.Values.tls.enabled) }}
            - name: weights-data
              containerPort: {{ $root.Values.ports.weightsData }}
              protocol: TCP
            {{- end }}
          env:
            {{- include "rlhf.env" $ctx | trim | nindent 12 }}
          {{- include "rlhf.probes" $ctx | trim | nindent 10 }}
          {{- if and (include "rlhf.drains" $component) (gt (int $root.Values.settings.preStopSeconds) 0) }}
          lifecycle:
            preStop:  # out of the Services' endpoints before SIGTERM stops the servers (settings.preStopSeconds)
              exec:
                command: ["sleep", {{ $root.Values.settings.preStopSeconds | quote }}]
          {{- end }}
          resources:
            {{- include "rlhf.resources" $values | trim | nindent 12 }}
          {{- with $root.Values.containerSecurityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            {{- include "rlhf.volumeMounts" $ctx | trim | nindent 12 }}
      volumes:
        {{- include "rlhf.volumes" $ctx | trim | nindent 8 }}
{{- end }}

{{/* ClusterIP Service (grpc + http) for a component; (dict "root" $ "component" NAME) */}}
{{- define "rlhf.service" -}}
{{- $root := .root }}
{{- $values := index $root.Values .component }}
{{- $ctx := dict "root" $root "component" .component "values" $values }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "rlhf.componentName" $ctx }}
  labels:
    {{- include "rlhf.labels" $ctx | trim | nindent 4 }}
    rlhf-pipeline/metrics: "true"
  {{- with $values.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ $values.service.type }}
  selector:
    {{- include "rlhf.selectorLabels" $ctx | trim | nindent 4 }}
    {{- with .extraSelector }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: grpc
      port: {{ $root.Values.ports.grpc }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: http
      port: {{ $root.Values.ports.http }}
      targetPort: http
      protocol: TCP
{{- end }}

{{/* PodDisruptionBudget for a component; (dict "root" $ "component" NAME) */}}
{{- define "rlhf.pdb" -}}
{{- $root := .root }}
{{- $values := index $root.Values .component }}
{{- $ctx := dict "root" $root "component" .component "values" $values }}
{{- if and (include "rlhf.componentEnabled" $ctx) $values.pdb.enabled }}
{{- /* a minAvailable (a count) that every replica count allowed meets would block each voluntary eviction */}}
{{- $min := $values.pdb.minAvailable }}
{{- if and (hasKey $values.pdb "minAvailable") (not (kindIs "string" $min)) (ne .component "trainer") }}
{{- $keda := and (include "rlhf.drains" .component) (dig "autoscaling" "keda" "enabled" false $values) }}
{{- $fewest := 1 }}
{{- if $keda }}{{ $fewest = $values.autoscaling.keda.minReplicas }}
{{- else if eq .component "environment" }}{{ $fewest = include "rlhf.environmentReplicas" $root }}
{{- else if hasKey $values "replicas" }}{{ $fewest = $values.replicas }}
{{- end }}
{{- if and (gt (int $min) 0) (ge (int $min) (int $fewest)) }}
{{- fail (printf "%s.pdb.minAvailable %d with as few as %d replica(s)%s: no voluntary eviction could ever proceed and node drains would hang; set it below %d or use maxUnavailable" .component (int $min) (int $fewest) (ternary " (autoscaling.keda.minReplicas)" "" $keda) (int $fewest)) }}
{{- end }}
{{- end }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "rlhf.componentName" $ctx }}
  labels:
    {{- include "rlhf.labels" $ctx | trim | nindent 4 }}
spec:
  {{- if hasKey $values.pdb "minAvailable" }}
  minAvailable: {{ $values.pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ $values.pdb.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "rlhf.selectorLabels" $ctx | trim | nindent 6 }}
{{- end }}
{{- end }}

{{/* ------------------------------------------------------------------ the training service */}}

{{/* The users' keys come from a Secret of their own: the chart's API token is the admin token (weight sync, the
     trainer's admin calls), not one to hand to every SDK user, and the SDK sends only keys that start with tml-. */}}
{{/* The config's training_service.enabled is `rlhf up`'s switch; the chart has its own (training.enabled). A config
     that asks for the service under a release that leaves it off fails the render rather than being ignored. */}}
{{- define "rlhf.trainingConfigGuard" -}}
{{- if and (not .Values.training.enabled) (not .Values.experiment.existingConfigMap) }}
{{- $cfg := include "rlhf.experimentYaml" . | fromYaml }}
{{- $section := get $cfg "training_service" }}
{{- if and (kindIs "map" $section) (get $section "enabled") }}
{{- fail "the experiment config sets training_service.enabled, which is rlhf up's switch: in the chart the training service is training.enabled (with training.auth.existingSecret). Set those, or drop training_service from the config" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rlhf.trainingGuard" -}}
{{- if not .Values.training.auth.existingSecret }}
{{- fail "training.enabled needs training.auth.existingSecret: a Secret whose key training.auth.existingSecretKey (default training-tokens) holds the users' keys, comma-separated, each starting with tml- (kubectl create secret generic rlhf-training-tokens --from-literal=training-tokens=tml-alice,tml-bob)" }}
{{- end }}
{{- end }}

{{/* ------------------------------------------------------------------ the trainer */}}

{{- define "rlhf.trainerGuard" -}}
{{- $v := .Values.trainer }}
{{- if and (ne $v.accelerator.type "none") (ne (int $v.accelerator.count) (int $v.torchrun.nprocPerNode)) }}
{{- fail (printf "trainer.accelerator.count (%d) must equal trainer.torchrun.nprocPerNode (%d): torchrun starts one process per device" (int $v.accelerator.count) (int $v.torchrun.nprocPerNode)) }}
{{- end }}
{{- end }}

{{/* The trainer Job's pod template; (dict "root" $) */}}
{{- define "rlhf.trainerPodTemplate" -}}
{{- $root := .root }}
{{- $values := $root.Values.trainer }}
{{- $ctx := dict "root" $root "component" "trainer" "values" $values }}
{{- $name := include "rlhf.componentName" $ctx }}
{{- $tr := $values.torchrun }}
template:
  metadata:
    labels:
      {{- include "rlhf.selectorLabels" $ctx | trim | nindent 6 }}
      {{- with $values.podLabels }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- with include "rlhf.podAnnotations" $ctx | trim }}
    annotations:
      {{- . | nindent 6 }}
    {{- end }}
  spec:
    {{- include "rlhf.podCommon" $ctx | trim | nindent 4 }}
    restartPolicy: OnFailure
    subdomain: {{ $name }}-headless
    containers:
      - name: trainer
        image: {{ include "rlhf.image" $ctx | quote }}
        imagePullPolicy: {{ $values.image.pullPolicy | default $root.Values.image.pullPolicy }}
        args:
          - torchrun
          - --nnodes={{ $tr.nnodes }}
          - --nproc-per-node={{ $tr.nprocPerNode }}
          {{- if eq (int $tr.nnodes) 1 }}
          - --standalone
          {{- else }}
          {{- /* static rendezvous on pod 0's stable name (<job>-0, indexed Job, under the headless Service), each
               pod's node rank its completion index (PET_NODE_RANK below): global rank 0, the one rank that serves,
               is then on pod 0, which the trainer Service selects. c10d would rank the nodes by address, and ignores
               --node-rank (torchrun honours it for static only). */}}
          - --rdzv-backend=static
          - --master-addr={{ $name }}-0.{{ $name }}-headless.{{ include "rlhf.svcDomain" $root }}
          - --master-port={{ $tr.rdzvPort }}
          {{- end }}
          - -m
          - services.cli
          - serve
          - trainer
          - --config
          - /etc/rlhf/config.yaml
          - --grpc-port
          - {{ include "rlhf.listenPort" (dict "root" $root "component" "trainer" "port" "grpc") | quote }}
          - --http-port
          - {{ include "rlhf.listenPort" (dict "root" $root "component" "trainer" "port" "http") | quote }}
        ports:
          - name: grpc
            containerPort: {{ include "rlhf.listenPort" (dict "root" $root "component" "trainer" "port" "grpc") }}
            protocol: TCP
          - name: http
            containerPort: {{ include "rlhf.listenPort" (dict "root" $root "component" "trainer" "port" "http") }}
            protocol: TCP
          - name: rendezvous
            containerPort: {{ $tr.rdzvPort }}
            protocol: TCP
        env:
          {{- include "rlhf.env" $ctx | trim | nindent 10 }}
          {{- if gt (int $tr.nnodes) 1 }}
          - name: PET_NODE_RANK  # torchrun's --node-rank, read from the environment: the pod's completion index
            valueFrom:
              fieldRef:
                fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
          {{- end }}
        {{- if eq (int $tr.nnodes) 1 }}
        {{- include "rlhf.probes" $ctx | trim | nindent 8 }}
        {{- end }}
        resources:
          {{- include "rlhf.resources" $values | trim | nindent 10 }}
        {{- with $root.Values.containerSecurityContext }}
        securityContext:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        volumeMounts:
          {{- include "rlhf.volumeMounts" $ctx | trim | nindent 10 }}
          - name: checkpoints
            mountPath: {{ $values.checkpoints.mountPath }}
    volumes:
      {{- include "rlhf.volumes" $ctx | trim | nindent 6 }}
      - name: checkpoints
        {{- if $values.checkpoints.persistence.enabled }}
        persistentVolumeClaim:
          claimName: {{ $values.checkpoints.persistence.existingClaim | default (printf "%s-checkpoints" $name) }}
        {{- else }}
        emptyDir: {}
        {{- end }}
{{- end }}

{{/* The trainer's RLHF_WEIGHTS_TRANSPORT / RLHF_WEIGHTS_COLLECTIVE_BACKEND (weightSync); values that would be ignored
     or refused at start fail the render. */}}
{{- define "rlhf.weightSyncEnv" -}}
{{- $w := .Values.weightSync }}
{{- if and (ne $w.collectiveBackend "auto") (ne $w.transport "collective") }}
{{- fail (printf "weightSync.collectiveBackend=%s applies with weightSync.transport=collective only" $w.collectiveBackend) }}
{{- end }}
{{- if and (has $w.transport (list "tcp" "collective")) .Values.tls.enabled }}
{{- fail (printf "weightSync.transport=%s sends weights in plaintext: use auto or grpc with tls.enabled" $w.transport) }}
{{- end }}
{{- if ne $w.transport "auto" }}
- name: RLHF_WEIGHTS_TRANSPORT
  value: {{ $w.transport | quote }}
{{- end }}
{{- if ne $w.collectiveBackend "auto" }}
- name: RLHF_WEIGHTS_COLLECTIVE_BACKEND
  value: {{ $w.collectiveBackend | quote }}
{{- end }}
{{- if eq (toString $w.delta) "auto" }}
{{- $tr := .Values.trainer.torchrun }}
{{- if eq $w.transport "collective" }}
{{- fail "weightSync.delta=auto applies over tcp / grpc / auto: a collective push always goes in full (docs/weight-sync.md, Delta pushes)" }}
{{- end }}
{{- if gt (mul (int $tr.nnodes) (int $tr.nprocPerNode)) 1 }}
{{- fail (printf "weightSync.delta=auto applies to a one-process trainer: a trainer group (torchrun.nnodes %d x nprocPerNode %d) streams its pushes in full" (int $tr.nnodes) (int $tr.nprocPerNode)) }}
{{- end }}
- name: RLHF_WEIGHTS_DELTA
  value: auto
{{- end }}
{{- end }}
