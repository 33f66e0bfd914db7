"""Writes the chart's values.schema.json: `python k8s/gen_values_schema.py > k8s/rlhf-pipeline/values.schema.json`.

The schema validates every key of values.yaml (`additionalProperties: false`, so a misspelt key fails `helm install`);
tests/deploy checks that it is current and that every key of values.yaml is in it and documented.
"""

import json


def s(t, d, **kw):
    out = {"type": t, "description": d}
    out.update(kw)
    return out


def obj(props, d=None, required=None, addl=False):
    o = {"type": "object", "additionalProperties": addl, "properties": props}
    if d:
        o["description"] = d
    if required:
        o["required"] = required
    return o


def freeobj(d):
    return {"type": "object", "description": d}


def hostports(d):
    return {"type": "array", "description": d, "items": {"type": "string", "pattern": "^[^:,/@]+:[0-9]+$"}}


quantity = {"type": ["string", "integer"], "pattern": "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$"}

defs = {
    "image": obj(
        {
            "repository": s("string", "image repository (prefixed by image.registry)", minLength=1),
            "tag": s("string", "image tag; empty: <appVersion>-<flavour>"),
            "digest": s("string", "image digest; wins over the tag", pattern="^(sha256:[a-f0-9]{64})?$"),
            "pullPolicy": s(
                "string", "pull policy; empty: image.pullPolicy", enum=["", "Always", "IfNotPresent", "Never"]
            ),
        },
        "the component's image",
        required=["repository"],
    ),
    "accelerator": obj(
        {
            "type": s(
                "string",
                "none (CPU), nvidia (nvidia.com/gpu) or ascend (huawei.com/Ascend910)",
                enum=["none", "nvidia", "ascend"],
            ),
            "count": s("integer", "accelerators per pod", minimum=1),
            "resourceName": s("string", "extended-resource name override", pattern="^([a-z0-9.-]+/[A-Za-z0-9._-]+)?$"),
        },
        "accelerator requests",
        required=["type", "count"],
    ),
    "probe": obj(
        {
            "enabled": s("boolean", "probe on"),
            "path": s("string", "HTTP path", pattern="^/"),
            "initialDelaySeconds": s("integer", "seconds before the first probe", minimum=0),
            "periodSeconds": s("integer", "seconds between probes", minimum=1),
            "timeoutSeconds": s("integer", "seconds per probe", minimum=1),
            "failureThreshold": s("integer", "failures allowed", minimum=1),
        },
        "an HTTP probe on the http port",
        required=["enabled", "path", "periodSeconds", "timeoutSeconds", "failureThreshold"],
    ),
    "probes": obj(
        {
            "startup": {"$ref": "#/definitions/probe"},
            "liveness": {"$ref": "#/definitions/probe"},
            "readiness": {"$ref": "#/definitions/probe"},
        },
        "startup, liveness and readiness probes",
        required=["startup", "liveness", "readiness"],
    ),
    "pdb": {
        "type": "object",
        "additionalProperties": False,
        "description": "PodDisruptionBudget",
        "properties": {
            "enabled": s("boolean", "PodDisruptionBudget on"),
            "maxUnavailable": {
                "type": ["integer", "string"],
                "description": "pods a voluntary disruption may take at once",
            },
            "minAvailable": {
                "type": ["integer", "string"],
                "description": "pods that must stay up (instead of maxUnavailable)",
            },
        },
        "required": ["enabled"],
    },
    "service": obj(
        {
            "type": s("string", "Service type", enum=["ClusterIP", "NodePort", "LoadBalancer"]),
            "annotations": {
                "type": "object",
                "description": "Service annotations",
                "additionalProperties": {"type": "string"},
            },
        },
        "the component's Service",
    ),
    "resources": obj(
        {
            "requests": {"type": "object", "description": "requests", "additionalProperties": quantity},
            "limits": {"type": "object", "description": "limits", "additionalProperties": quantity},
            "claims": {"type": "array", "description": "dynamic resource claims"},
        },
        "container resources (the accelerator is added)",
    ),
    "envList": {
        "type": "array",
        "description": "extra environment variables (EnvVar list)",
        "items": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}},
    },
    "peers": {"type": "array", "description": "NetworkPolicyPeer list", "items": {"type": "object"}},
    "strategy": {
        "type": "object",
        "description": "Deployment strategy",
        "properties": {
            "type": {"type": "string", "enum": ["RollingUpdate", "Recreate"]},
            "rollingUpdate": {"type": "object"},
        },
    },
}


def pod_common():
    return {
        "enabled": s("boolean", "deploy this component"),
        "image": {"$ref": "#/definitions/image"},
        "accelerator": {"$ref": "#/definitions/accelerator"},
        "resources": {"$ref": "#/definitions/resources"},
        "shmSize": {**quantity, "description": "size of the in-memory /dev/shm"},
        "env": {"$ref": "#/definitions/envList"},
        "nodeSelector": {"type": "object", "description": "node selector", "additionalProperties": {"type": "string"}},
        "tolerations": {"type": "array", "description": "tolerations", "items": {"type": "object"}},
        "affinity": freeobj("affinity"),
        "podAnnotations": {
            "type": "object",
            "description": "extra pod annotations",
            "additionalProperties": {"type": "string"},
        },
        "podLabels": {"type": "object", "description": "extra pod labels", "additionalProperties": {"type": "string"}},
        "runtimeClassName": s("string", "RuntimeClass"),
        "priorityClassName": s("string", "PriorityClass"),
        "terminationGracePeriodSeconds": s("integer", "seconds between SIGTERM and SIGKILL", minimum=0),
        "service": {"$ref": "#/definitions/service"},
        "probes": {"$ref": "#/definitions/probes"},
        "pdb": {"$ref": "#/definitions/pdb"},
    }


def keda_common(what, fewest=1):
    return {
        "enabled": s("boolean", what),
        "minReplicas": s("integer", "fewest replicas", minimum=fewest),
        "maxReplicas": s("integer", "most replicas", minimum=1),
        "pollingInterval": s("integer", "seconds between checks", minimum=1),
        "cooldownPeriod": s("integer", "seconds before scaling down", minimum=0),
    }


def stateless(extra=None):
    p = pod_common()
    p["replicas"] = s("integer", "replicas", minimum=0)
    p["terminationGracePeriodSeconds"] = {
        "type": ["integer", "null"],
        "minimum": 0,
        "description": "seconds between SIGTERM and SIGKILL; null: settings.preStopSeconds plus the service's drain",
    }
    p["strategy"] = {"$ref": "#/definitions/strategy"}
    p.update(extra or {})
    return obj(p, required=["enabled", "image", "accelerator", "probes"])


rollout = stateless(
    {
        "engine": s("string", "RLHF_ROLLOUT_ENGINE; empty: the config decides", enum=["", "vllm", "hf"]),
        "autoscaling": obj(
            {
                "keda": obj(
                    {
                        **keda_common("scale rollout with KEDA on the prompts stream", fewest=0),
                        "jobsPerReplica": {
                            "type": ["integer", "null"],
                            "minimum": 1,
                            "description": "target of jobs held + jobs waiting per replica; null: the replica's slots",
                        },
                        "redisAddress": s("string", "host:port of Redis for KEDA", pattern="^([^:]+:[0-9]+)?$"),
                        "passwordSecret": obj(
                            {"name": s("string", "Secret name"), "key": s("string", "Secret key")},
                            "Redis password for KEDA",
                        ),
                    },
                    "KEDA ScaledObject",
                ),
            },
            "autoscaling",
        ),
    }
)


def scorer_autoscaling(component):
    return obj(
        {
            "keda": obj(
                {
                    **keda_common(f"scale {component} with KEDA on its calls in flight (Prometheus)"),
                    "requestsPerReplica": {
                        "type": ["number", "string"],
                        "pattern": "^[0-9]+(\\.[0-9]+)?$",
                        "description": "target of calls in flight (rlhf_requests_in_flight) per replica",
                    },
                    "window": s(
                        "string", "PromQL range the calls in flight are averaged over", pattern="^[0-9]+(ms|s|m|h)$"
                    ),
                    "query": s("string", "PromQL of the trigger; empty: the chart's, on the ServiceMonitor's labels"),
                },
                "KEDA ScaledObject",
            ),
        },
        "autoscaling",
    )


# The environment service: torch-free, on the CPU (no accelerator); enabled and replicas default to the config's.
environment_props = pod_common()
del environment_props["accelerator"]
environment_props["enabled"] = {
    "type": ["boolean", "null"],
    "description": "deploy the environment service; null: when the experiment config sets environment.name",
}
environment_props["replicas"] = {
    "type": ["integer", "null"],
    "minimum": 0,
    "description": "replicas; null: the config's environment.replicas",
}
environment_props["strategy"] = {"$ref": "#/definitions/strategy"}
environment = obj(environment_props, required=["image", "probes"])

trainer_props = pod_common()
trainer_props["job"] = obj(
    {
        "backoffLimit": s("integer", "restarts on failure before the Job fails", minimum=0),
        "ttlSecondsAfterFinished": {
            "type": ["integer", "null"],
            "minimum": 0,
            "description": "delete the finished Job after this many seconds",
        },
    },
    "the trainer Job (indexed: one pod per torchrun node; restarted on failure only)",
)
trainer_props["torchrun"] = obj(
    {
        "nnodes": s("integer", "torchrun --nnodes (pods, one per node)", minimum=1),
        "nprocPerNode": s("integer", "torchrun --nproc-per-node (one per device)", minimum=1),
        "rdzvPort": s("integer", "c10d rendezvous port", minimum=1, maximum=65535),
    },
    "torchrun",
    required=["nnodes", "nprocPerNode"],
)
trainer_props["hostNetworkPorts"] = obj(
    {
        "grpc": s("integer", "trainer gRPC port on the node's network", minimum=1, maximum=65535),
        "http": s("integer", "trainer HTTP port on the node's network", minimum=1, maximum=65535),
    },
    "the trainer's container ports with weightSync.hostNetwork",
    required=["grpc", "http"],
)
trainer_props["checkpoints"] = obj(
    {
        "mountPath": s("string", "mount path of the checkpoint volume", pattern="^/"),
        "persistence": obj(
            {
                "enabled": s("boolean", "PVC on"),
                "existingClaim": s("string", "existing PVC"),
                "storageClass": s("string", "storage class"),
                "accessModes": {
                    "type": "array",
                    "description": "access modes",
                    "minItems": 1,
                    "items": {
                        "type": "string",
                        "enum": ["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod", "ReadOnlyMany"],
                    },
                },
                "size": {**quantity, "description": "size"},
                "keep": s("boolean", "keep the PVC on uninstall"),
            },
            "checkpoint PVC",
        ),
    },
    "checkpoints",
)
trainer = obj(trainer_props, required=["enabled", "image", "accelerator", "probes", "torchrun"])

# The training service (tinker SDK API): one pod (sessions live in its memory), its checkpoints on a PVC like the
# trainer's, the users' keys from a Secret.
training_props = pod_common()
training_props["strategy"] = {"$ref": "#/definitions/strategy"}
training_props["checkpoints"] = trainer_props["checkpoints"]
training_props["auth"] = obj(
    {
        "existingSecret": s("string", "Secret with the users' keys (RLHF_TRAINING_TOKENS); required when enabled"),
        "existingSecretKey": s("string", "key of the keys in that Secret", minLength=1),
    },
    "the users' keys",
)
training = obj(training_props, required=["enabled", "image", "accelerator", "probes", "auth"])

schema = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "rlhf-pipeline Helm values",
    "type": "object",
    "additionalProperties": False,
    "definitions": defs,
    "properties": {
        "nameOverride": s("string", "chart name override"),
        "fullnameOverride": s("string", "full name override"),
        "clusterDomain": s("string", "cluster DNS domain", minLength=1),
        "global": freeobj("Helm global values (unused)"),
        "image": obj(
            {
                "registry": s("string", "registry prefix"),
                "tag": s("string", "default tag"),
                "pullPolicy": s("string", "default pull policy", enum=["Always", "IfNotPresent", "Never"]),
                "pullSecrets": {
                    "type": "array",
                    "description": "image pull secrets",
                    "items": {"type": "object", "required": ["name"]},
                },
            },
            "image defaults",
        ),
        "experiment": obj(
            {
                "runId": s("string", "run id", pattern="^([A-Za-z0-9_.-]+)?$"),
                "existingConfigMap": s("string", "existing ConfigMap with config.yaml"),
                "configYaml": s("string", "experiment config as YAML text"),
                "config": freeobj("experiment config (rlhf.config.ExperimentConfig)"),
            },
            "the experiment",
        ),
        "auth": obj(
            {
                "apiToken": s("string", "API token; empty: generated"),
                "existingSecret": s("string", "existing Secret with the token"),
                "existingSecretKey": s("string", "key of the token", minLength=1),
            },
            "API token",
        ),
        "tls": obj(
            {
                "enabled": s("boolean", "TLS on"),
                "existingSecret": s("string", "kubernetes.io/tls Secret"),
                "caKey": s("string", "CA bundle key in the Secret (RLHF_TLS_CA of rollout, trainer)", minLength=1),
            },
            "TLS",
        ),
        "ports": obj(
            {
                "grpc": s("integer", "gRPC port", minimum=1, maximum=65535),
                "http": s("integer", "HTTP port", minimum=1, maximum=65535),
                "weightsData": s(
                    "integer",
                    "rollout's weight-sync data port (RLHF_WEIGHTS_DATA_PORT); 0 = off",
                    minimum=0,
                    maximum=65535,
                ),
            },
            "ports",
            required=["grpc", "http"],
        ),
        "weightSync": obj(
            {
                "transport": s(
                    "string", "RLHF_WEIGHTS_TRANSPORT of the trainer", enum=["auto", "tcp", "grpc", "collective"]
                ),
                "collectiveBackend": s(
                    "string",
                    "RLHF_WEIGHTS_COLLECTIVE_BACKEND of the trainer (transport collective)",
                    enum=["auto", "gloo", "nccl", "hccl"],
                ),
                "hostNetwork": s(
                    "boolean",
                    "trainer and rollout pods on their node's network (HCCL between pods of one node over HCCS)",
                ),
                "delta": s("string", "RLHF_WEIGHTS_DELTA of the trainer (delta pushes)", enum=["off", "auto"]),
            },
            "how the trainer pushes weights to the rollout replicas",
        ),
        "settings": obj(
            {
                "logLevel": s("string", "RLHF_LOG_LEVEL", enum=["debug", "info", "warning", "error", "critical"]),
                "maxMessageBytes": s("integer", "RLHF_MAX_MESSAGE_BYTES", minimum=1),
                "maxBodyBytes": s("integer", "RLHF_MAX_BODY_BYTES", minimum=1),
                "shutdownGraceSeconds": s("number", "RLHF_SHUTDOWN_GRACE_S", minimum=0),
                "preStopSeconds": s("integer", "preStop sleep of rollout, reward and reference pods", minimum=0),
                "grpcMaxConnectionAgeSeconds": {
                    "type": ["number", "null"],
                    "exclusiveMinimum": 0,
                    "description": "RLHF_GRPC_MAX_CONNECTION_AGE_S of reward and reference; null: not set",
                },
                "hfHubOffline": s("boolean", "HF_HUB_OFFLINE"),
            },
            "service settings (RLHF_*)",
        ),
        "serviceAccount": obj(
            {
                "create": s("boolean", "create a ServiceAccount"),
                "name": s("string", "its name"),
                "annotations": {
                    "type": "object",
                    "description": "its annotations",
                    "additionalProperties": {"type": "string"},
                },
            },
            "ServiceAccount",
        ),
        "podSecurityContext": freeobj("pod securityContext of the rlhf pods"),
        "containerSecurityContext": freeobj("container securityContext of the rlhf containers"),
        "extraVolumes": {
            "type": "array",
            "description": "extra volumes",
            "items": {"type": "object", "required": ["name"]},
        },
        "extraVolumeMounts": {
            "type": "array",
            "description": "extra volumeMounts",
            "items": {"type": "object", "required": ["name", "mountPath"]},
        },
        "ascend": obj(
            {
                "soc": s(
                    "string",
                    "Atlas generation: 910b (A2) or a3 (A3); picks the image flavour and the node affinity",
                    enum=["910b", "a3"],
                ),
                "nodeAffinity": obj(
                    {
                        "enabled": s("boolean", "require nodes of ascend.soc for the Ascend components"),
                        "key": s("string", "node label of the Ascend device plugin", minLength=1),
                        "values": obj(
                            {
                                soc: {
                                    "type": "array",
                                    "description": f"label values of {soc} nodes",
                                    "minItems": 1,
                                    "items": {"type": "string", "minLength": 1},
                                }
                                for soc in ("910b", "a3")
                            },
                            "label values per soc",
                            required=["910b", "a3"],
                        ),
                    },
                    "node affinity by SoC",
                ),
                "roce": obj(
                    {
                        "enabled": s("boolean", "the NPUs' RoCE fabric is configured (hccn.conf on every node)"),
                        "hccnConfPath": s("string", "the host's hccn.conf", pattern="^/"),
                    },
                    "RoCE fabric between the NPUs",
                ),
                "driverHostPaths": obj(
                    {
                        "enabled": s("boolean", "mount the host's Ascend driver files"),
                        "paths": {
                            "type": "array",
                            "description": "host paths",
                            "items": {"type": "string", "pattern": "^/"},
                        },
                    },
                    "Ascend driver host paths",
                ),
            },
            "Ascend",
        ),
        "rollout": rollout,
        "reward": stateless({"autoscaling": scorer_autoscaling("reward")}),
        "reference": stateless({"autoscaling": scorer_autoscaling("reference")}),
        "environment": environment,
        "trainer": trainer,
        "training": training,
        "redis": obj(
            {
                "enabled": s("boolean", "run Redis in the chart"),
                "image": obj(
                    {
                        "repository": s("string", "repository", minLength=1),
                        "tag": s("string", "tag"),
                        "digest": s("string", "digest", pattern="^(sha256:[a-f0-9]{64})?$"),
                        "pullPolicy": s("string", "pull policy", enum=["Always", "IfNotPresent", "Never"]),
                    },
                    "Redis image",
                ),
                "appendfsync": s("string", "AOF fsync policy", enum=["everysec", "always", "no"]),
                "auth": obj(
                    {
                        "enabled": s("boolean", "require a password"),
                        "password": s("string", "password (URL-safe)", pattern="^[A-Za-z0-9._~-]*$"),
                        "existingSecret": s("string", "existing Secret"),
                        "existingSecretPasswordKey": s("string", "key", minLength=1),
                    },
                    "auth",
                ),
                "persistence": obj(
                    {
                        "enabled": s("boolean", "PVC on"),
                        "storageClass": s("string", "storage class"),
                        "accessModes": {
                            "type": "array",
                            "description": "access modes",
                            "minItems": 1,
                            "items": {"type": "string"},
                        },
                        "size": {**quantity, "description": "size"},
                    },
                    "persistence",
                ),
                "resources": {"$ref": "#/definitions/resources"},
                "podSecurityContext": freeobj("pod securityContext"),
                "containerSecurityContext": freeobj("container securityContext"),
                "nodeSelector": {
                    "type": "object",
                    "description": "node selector",
                    "additionalProperties": {"type": "string"},
                },
                "tolerations": {"type": "array", "description": "tolerations", "items": {"type": "object"}},
                "affinity": freeobj("affinity"),
                "pdb": {"$ref": "#/definitions/pdb"},
                "external": obj(
                    {
                        "url": s(
                            "string",
                            "RLHF_REDIS_URL",
                            pattern="^((rediss?|rediss?\\+sentinel|rediss?\\+cluster)://.+)?$",
                        ),
                        "existingSecret": s("string", "existing Secret with the URL"),
                        "existingSecretUrlKey": s("string", "key", minLength=1),
                        "sentinel": obj(
                            {
                                "addresses": hostports("host:port of each sentinel"),
                                "serviceName": s("string", "master set name", pattern="^[A-Za-z0-9._-]+$"),
                            },
                            "external Sentinel group",
                        ),
                        "cluster": obj({"addresses": hostports("host:port of some nodes")}, "external Redis Cluster"),
                        "tls": s("boolean", "TLS to the sentinels / cluster nodes"),
                        "passwordSecret": obj(
                            {"name": s("string", "Secret name"), "key": s("string", "Secret key", minLength=1)},
                            "password of the Sentinel group / cluster",
                        ),
                        "waitReplicas": s("integer", "replicas each guarantee-bearing write waits for", minimum=0),
                        "waitTimeoutMs": s("integer", "WAIT timeout in ms", minimum=1),
                    },
                    "external Redis",
                ),
            },
            "Redis",
        ),
        "networkPolicy": obj(
            {
                "enabled": s("boolean", "NetworkPolicies on"),
                "clientsFrom": {"$ref": "#/definitions/peers"},
                "metricsFrom": {"$ref": "#/definitions/peers"},
                "adminFrom": {"$ref": "#/definitions/peers"},
                "nodesFrom": {"$ref": "#/definitions/peers"},
                "kedaFrom": {"$ref": "#/definitions/peers"},
            },
            "NetworkPolicies",
        ),
        "autoscaling": obj(
            {
                "prometheus": obj(
                    {"serverAddress": s("string", "Prometheus URL KEDA queries", pattern="^(https?://.+)?$")},
                    "the Prometheus that scrapes the services (reward and reference autoscaling)",
                ),
            },
            "autoscaling shared by the components",
        ),
        "serviceMonitor": obj(
            {
                "enabled": s("boolean", "ServiceMonitor on"),
                "labels": {"type": "object", "description": "extra labels", "additionalProperties": {"type": "string"}},
                "interval": s("string", "scrape interval", pattern="^[0-9]+(ms|s|m|h)$"),
                "scrapeTimeout": s("string", "scrape timeout", pattern="^[0-9]+(ms|s|m|h)$"),
            },
            "Prometheus ServiceMonitor",
        ),
    },
    "required": [
        "image",
        "experiment",
        "auth",
        "ports",
        "settings",
        "rollout",
        "reward",
        "reference",
        "trainer",
        "redis",
    ],
}


if __name__ == "__main__":
    print(json.dumps(schema, indent=2))
