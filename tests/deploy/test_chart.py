"""The Helm chart, rendered with `helm template` (default, GPU and NPU values) and read back as manifests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_contract import parse_container_command, unknown_env
from deploy_support import CHART, ROOT, SERVICES, containers, helm_template, parse_docs, render

from rlhf.config import load_config, parse_config
from rlhf.serving import ServiceSettings
from rlhf.transport.connection import WaitPolicy, parse_redis_url
from tests.cluster import triggers

ACCELERATOR = {"gpu": "nvidia.com/gpu", "npu": "huawei.com/Ascend910"}
DEVICE = {"default": "cpu", "gpu": "cuda", "npu": "npu"}
IMAGE_FLAVOUR = {"default": "cpu", "gpu": "cuda", "npu": "ascend-910b"}
# The Ascend device plugin's accelerator-type values of each Atlas generation (values.yaml ascend.nodeAffinity)
ASCEND_NODE_TYPES = {
    "910b": {"module-910b-8", "module-910b-16", "card-910b-2"},
    "a3": {"module-a3-16", "module-a3-16-super-pod"},
}
NPU = ("-f", "k8s/examples/values-npu.yaml", "--set-file", "experiment.configYaml=configs/llama32-1b-ppo.yaml")


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_renders_every_component(rendered):
    for name, r in rendered.items():
        assert set(r.service_workloads()) == set(SERVICES), name
        assert r.component("Deployment", "rollout")
        assert r.component("Job", "trainer")
        assert r.component("StatefulSet", "redis")
        for comp in ("rollout", "reward", "reference", "trainer"):
            ports = {p["name"]: p["port"] for p in r.component("Service", comp)["spec"]["ports"]}
            assert ports["grpc"] == 50051 and ports["http"] == 8000, (name, comp, ports)
        assert len(r.kind("PodDisruptionBudget")) == 5, name
        assert len(r.kind("NetworkPolicy")) == 5, name


@pytest.mark.parametrize("example", ["gpu", "npu"])
def test_examples_request_accelerators_for_model_services_and_trainer(rendered, example):
    resource = ACCELERATOR[example]
    for comp, workload in rendered[example].service_workloads().items():
        (c,) = containers(workload)
        for side in ("requests", "limits"):
            assert c["resources"][side].get(resource) == "1", f"{example}: {comp} {side} lack {resource}"
        other = set(ACCELERATOR.values()) - {resource}
        assert not other & set(c["resources"]["limits"]), f"{example}: {comp} asks for the other accelerator"
        assert env_of(c)["RLHF_DEVICE"]["value"] == DEVICE[example]
        assert c["image"].endswith(f"-{IMAGE_FLAVOUR[example]}"), c["image"]


def test_default_is_cpu_only(rendered):
    for comp, workload in rendered["default"].service_workloads().items():
        (c,) = containers(workload)
        limits = c["resources"].get("limits", {})
        assert not set(ACCELERATOR.values()) & set(limits), comp
        assert env_of(c)["RLHF_DEVICE"]["value"] == "cpu"
        assert c["image"] == f"rlhf-pipeline/{comp}:0.1.0-cpu"


def test_accelerator_count_and_resource_name_come_from_values(helm):
    r = render(
        helm,
        "--set",
        "trainer.accelerator.type=ascend",
        "--set",
        "trainer.accelerator.count=8",
        "--set",
        "trainer.accelerator.resourceName=huawei.com/Ascend910B",
        "--set",
        "trainer.torchrun.nprocPerNode=8",
    )
    (c,) = containers(r.component("Job", "trainer"))
    assert c["resources"]["limits"]["huawei.com/Ascend910B"] == "8"
    assert c["resources"]["requests"]["huawei.com/Ascend910B"] == "8"


def test_npu_example_mounts_the_ascend_driver_and_joins_its_group(rendered):
    for comp, workload in rendered["npu"].service_workloads().items():
        spec = workload["spec"]["template"]["spec"]
        host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        assert {"/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi"} <= host_paths, comp
        assert spec["securityContext"]["supplementalGroups"], comp
        assert spec["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
        # vllm-ascend runs on Atlas A2/A3 only, and an image on its own generation only: the example's soc (910b)
        # admits A2 nodes, not A3 or 910A ones (test_ascend_soc_picks_the_images_and_the_nodes has both socs)
        assert _ascend_node_types(spec) == [ASCEND_NODE_TYPES["910b"]], comp
    for comp, workload in rendered["gpu"].service_workloads().items():
        spec = workload["spec"]["template"]["spec"]
        assert not [v for v in spec["volumes"] if "hostPath" in v], f"gpu: {comp} mounts host paths"


def test_every_container_command_is_accepted_by_the_rlhf_cli(rendered):
    for name, r in rendered.items():
        for comp, workload in r.service_workloads().items():
            (c,) = containers(workload)
            assert "command" not in c, f"{comp}: keep the image's entrypoint (it loads the Ascend environment)"
            ns = parse_container_command(c["args"])
            assert (ns.command, ns.service) == ("serve", comp), (name, comp, c["args"])
            assert ns.config == "/etc/rlhf/config.yaml"
            assert (ns.grpc_port, ns.http_port) == (50051, 8000)


def test_trainer_runs_under_torchrun_single_node_by_default(rendered):
    for r in rendered.values():
        job = r.component("Job", "trainer")
        assert job["spec"]["completions"] == job["spec"]["parallelism"] == 1
        (c,) = containers(job)
        assert c["args"][:4] == ["torchrun", "--nnodes=1", "--nproc-per-node=1", "--standalone"]


def _torchrun_args(container: dict):
    from torch.distributed.run import get_args_parser  # noqa: PLC0415 - torch: only for a torchrun command line, the deploy checks load no torch otherwise

    assert container["args"][0] == "torchrun"
    return get_args_parser().parse_args(container["args"][1:])


def test_multi_node_trainer_renders_two_nodes_by_two_processes(helm):
    """2 nodes x 2 GPUs: one pod per node, torchrun's own parser reads a static rendezvous on pod 0's stable name with
    each pod's node rank its completion index, so global rank 0 (the one that serves) is on pod 0, the only pod the
    trainer Service selects."""
    r = render(
        helm,
        "-f",
        "k8s/examples/values-gpu.yaml",
        "--set",
        "trainer.torchrun.nnodes=2",
        "--set",
        "trainer.torchrun.nprocPerNode=2",
        "--set",
        "trainer.accelerator.count=2",
    )
    workload = r.component("Job", "trainer")
    name = workload["metadata"]["name"]
    assert workload["spec"]["completions"] == workload["spec"]["parallelism"] == 2
    headless = workload["spec"]["template"]["spec"]["subdomain"]
    (c,) = containers(workload)
    tr = _torchrun_args(c)
    assert (tr.nnodes, tr.nproc_per_node, tr.rdzv_backend, tr.standalone) == ("2", "2", "static", False)
    assert tr.master_addr.startswith(f"{name}-0.{headless}.") and tr.master_port == 29500
    rank = next(e for e in c["env"] if e["name"] == "PET_NODE_RANK")  # torchrun's --node-rank from the environment
    assert (
        rank["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    service = next(s for s in r.kind("Service") if s["metadata"]["name"] == name)
    assert service["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"
    headless_svc = next(s for s in r.kind("Service") if s["metadata"]["name"] == headless)
    assert "batch.kubernetes.io/job-completion-index" not in headless_svc["spec"]["selector"]  # every pod's DNS name
    assert parse_container_command(c["args"]).service == "trainer"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"NCCL_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING"} <= set(env_of(c))
    # only global rank 0 serves HTTP: no HTTP probe may kill the other nodes' pods
    assert not {"livenessProbe", "readinessProbe", "startupProbe"} & set(c)


def test_trainer_needs_one_device_per_process(helm):
    proc = helm_template(
        helm, "-f", "k8s/examples/values-gpu.yaml", "--set", "trainer.torchrun.nprocPerNode=2", check=False
    )
    assert proc.returncode != 0 and "must equal trainer.torchrun.nprocPerNode" in proc.stderr


def test_trainer_is_an_indexed_job_that_is_not_restarted_once_finished(helm, rendered):
    """A finished trainer exits 0 and must stay finished: a StatefulSet (restartPolicy Always) would start it again
    and again. An indexed Job restarts it on failure only (it resumes from its checkpoint)."""
    for r in rendered.values():
        labels = [(w["kind"], w["metadata"]["labels"]["app.kubernetes.io/component"]) for w in r.workloads()]
        kinds = [kind for kind, comp in labels if comp == "trainer"]
        assert kinds == ["Job"]
    r = render(helm, "--set", "trainer.job.backoffLimit=7", "--set", "trainer.job.ttlSecondsAfterFinished=600")
    (job,) = r.kind("Job")
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 1
    assert (job["spec"]["backoffLimit"], job["spec"]["ttlSecondsAfterFinished"]) == (7, 600)
    spec = job["spec"]["template"]["spec"]
    assert spec["restartPolicy"] == "OnFailure" and spec["subdomain"] == f"{job['metadata']['name']}-headless"
    (c,) = containers(job)
    assert parse_container_command(c["args"]).service == "trainer"
    assert "persistentVolumeClaim" in {v["name"]: v for v in spec["volumes"]}["checkpoints"]
    # the former switch is gone, and says so rather than being ignored
    proc = helm_template(helm, "--set", "trainer.kind=StatefulSet", check=False)
    assert proc.returncode != 0 and "kind" in proc.stderr


def test_omp_threads_follow_each_containers_cpu(helm, rendered):
    """torch sizes its thread pool by the node's cores unless OMP_NUM_THREADS says otherwise."""
    for comp, workload in rendered["default"].service_workloads().items():
        (c,) = containers(workload)
        res = c["resources"]
        cpu = str(res.get("limits", {}).get("cpu") or res.get("requests", {}).get("cpu") or "1")
        want = max(1, int(cpu[:-1]) // 1000) if cpu.endswith("m") else max(1, int(float(cpu)))
        assert env_of(c)["OMP_NUM_THREADS"]["value"] == str(want), comp
    r = render(
        helm,
        "--set",
        "trainer.resources.limits.cpu=3500m",
        "--set",
        "reward.resources.requests.cpu=250m",
        "--set-json",
        'reference.env=[{"name": "OMP_NUM_THREADS", "value": "5"}]',
    )
    envs = {comp: containers(w)[0]["env"] for comp, w in r.service_workloads().items()}
    assert env_of({"env": envs["trainer"]})["OMP_NUM_THREADS"]["value"] == "3"
    assert env_of({"env": envs["reward"]})["OMP_NUM_THREADS"]["value"] == "1"
    assert [e["value"] for e in envs["reference"] if e["name"] == "OMP_NUM_THREADS"] == ["5"], "the user's wins"


def test_env_vars_are_known_to_the_code(rendered, helm):
    extra = render(
        helm,
        "--set",
        "tls.enabled=true",
        "--set",
        "tls.existingSecret=t",
        "--set",
        "redis.enabled=false",
        "--set",
        "redis.external.url=redis://r:6379/0",
    )
    names = set()
    for r in [*rendered.values(), extra]:
        for workload in r.workloads():
            for c in containers(workload):
                names |= set(env_of(c))
    assert not unknown_env(names), f"the chart sets variables nothing reads: {unknown_env(names)}"


def test_service_wiring(rendered):
    r = rendered["default"]
    rollout = env_of(containers(r.component("Deployment", "rollout"))[0])
    trainer = env_of(containers(r.component("Job", "trainer"))[0])
    reward = env_of(containers(r.component("Deployment", "reward"))[0])
    dom = "rlhf.svc.cluster.local"
    assert rollout["RLHF_REWARD_ADDR"]["value"] == f"rlhf-rlhf-pipeline-reward.{dom}:50051"
    assert rollout["RLHF_REFERENCE_ADDR"]["value"] == f"rlhf-rlhf-pipeline-reference.{dom}:50051"
    assert trainer["RLHF_ROLLOUT_ADDRS"]["value"] == f"rlhf-rlhf-pipeline-rollout-headless.{dom}:50051"
    assert trainer["RLHF_REWARD_ADDR"]["value"] == f"rlhf-rlhf-pipeline-reward.{dom}:50051"  # eval scores
    headless = [s for s in r.kind("Service") if s["metadata"]["name"] == "rlhf-rlhf-pipeline-rollout-headless"]
    assert headless and headless[0]["spec"]["clusterIP"] == "None"
    assert rollout["RLHF_REDIS_URL"]["value"] == f"redis://:$(REDIS_PASSWORD)@rlhf-rlhf-pipeline-redis.{dom}:6379/0"
    assert list(rollout).index("REDIS_PASSWORD") < list(rollout).index("RLHF_REDIS_URL"), "$(VAR) needs VAR first"
    assert "RLHF_REDIS_URL" not in reward, "only rollout and the trainer use Redis"
    for env in (rollout, trainer, reward):
        assert "secretKeyRef" in env["RLHF_API_TOKEN"]["valueFrom"], "the token comes from a Secret"
        assert env["RLHF_RUN_ID"]["value"] == "demo"
        assert env["RLHF_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    for workload in r.workloads():
        spec = workload["spec"]["template"]["spec"]
        assert spec["enableServiceLinks"] is False, "service-link variables (RLHF_*_PORT) would look like settings"
        assert spec["automountServiceAccountToken"] is False


def test_external_redis_url_comes_from_a_secret(helm):
    r = render(helm, "--set", "redis.enabled=false", "--set", "redis.external.url=redis://:pw@redis.example:6379/0")
    assert not [s for s in r.kind("StatefulSet") if s["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"]
    env = env_of(containers(r.component("Deployment", "rollout"))[0])
    assert env["RLHF_REDIS_URL"]["valueFrom"]["secretKeyRef"]["key"] == "redis-url"
    proc = helm_template(helm, "--set", "redis.enabled=false", check=False)
    assert proc.returncode != 0 and "redis.external.url" in proc.stderr


SENTINEL = (
    "--set",
    "redis.enabled=false",
    "--set",
    "redis.external.sentinel.addresses={s1.redis:26379,s2.redis:26379}",
    "--set",
    "redis.external.passwordSecret.name=ext-redis",
    "--set",
    "rollout.autoscaling.keda.enabled=true",
)
CLUSTER = (
    "--set",
    "redis.enabled=false",
    "--set",
    "redis.external.cluster.addresses={n1.redis:6379}",
    "--set",
    "redis.external.tls=true",
    "--set",
    "rollout.autoscaling.keda.enabled=true",
)


def _redis_env(r) -> dict:
    """RLHF_REDIS_URL of rollout and the trainer (the same), with the password Kubernetes would expand."""
    envs = [env_of(containers(w)[0]) for w in (r.component("Deployment", "rollout"), r.component("Job", "trainer"))]
    assert envs[0]["RLHF_REDIS_URL"] == envs[1]["RLHF_REDIS_URL"]
    return envs[0]


def test_external_sentinel_group_builds_the_url_the_services_parse(helm):
    r = render(helm, *SENTINEL, "--set", "redis.external.waitReplicas=1", "--set", "redis.external.waitTimeoutMs=500")
    assert not [s for s in r.kind("StatefulSet") if s["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"]
    env = _redis_env(r)
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "ext-redis", "key": "redis-password"}
    assert list(env).index("REDIS_PASSWORD") < list(env).index("RLHF_REDIS_URL"), "$(VAR) needs VAR first"
    t = parse_redis_url(env["RLHF_REDIS_URL"]["value"].replace("$(REDIS_PASSWORD)", "pw"))
    assert t.kind == "sentinel" and t.hosts == (("s1.redis", 26379), ("s2.redis", 26379))
    assert t.service_name == "mymaster" and t.password == t.sentinel_password == "pw" and t.wait == WaitPolicy(1, 500)
    (so,) = r.kind("ScaledObject")
    assert len(so["spec"]["triggers"]) == 2  # jobs held and jobs waiting (test_keda_scales_rollout_on_demand)
    for trigger in so["spec"]["triggers"]:
        assert trigger["type"] == "redis-sentinel-streams" and trigger["metadata"]["sentinelMaster"] == "mymaster"
        assert trigger["metadata"]["addresses"] == "s1.redis:26379,s2.redis:26379"
        assert trigger["metadata"]["stream"] == "rlhf:{demo}:prompts"
    (auth,) = r.kind("TriggerAuthentication")
    assert {p["parameter"] for p in auth["spec"]["secretTargetRef"]} == {"password", "sentinelPassword"}
    assert all(p["name"] == "ext-redis" for p in auth["spec"]["secretTargetRef"])
    assert not any("redis-url" in (s.get("data") or {}) for s in r.kind("Secret")), "no URL Secret is needed"


def test_external_cluster_builds_the_url_the_services_parse(helm):
    r = render(helm, *CLUSTER)
    env = _redis_env(r)
    assert "REDIS_PASSWORD" not in env  # no passwordSecret: no password
    t = parse_redis_url(env["RLHF_REDIS_URL"]["value"])
    assert t.kind == "cluster" and t.tls and t.hosts == (("n1.redis", 6379),) and t.password is None
    (so,) = r.kind("ScaledObject")
    for trigger in so["spec"]["triggers"]:
        assert trigger["type"] == "redis-cluster-streams" and "databaseIndex" not in trigger["metadata"]
        assert trigger["metadata"]["enableTLS"] == "true"
    assert not r.kind("TriggerAuthentication")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--set", "redis.external.url=redis://h:6379/0"), "set one of url/existingSecret, sentinel.addresses"),
        (
            ("--set", "redis.external.url=redis://h:6379/0", "--set", "redis.external.cluster.addresses={n1:6379}"),
            "(got url, sentinel, cluster)",
        ),
        (
            (
                "--set",
                "redis.external.waitReplicas=1",
                "--set",
                "redis.external.sentinel.addresses=null",
                "--set",
                "redis.external.url=redis://h:6379/0",
            ),
            "put wait_replicas=N in the URL",
        ),
        (("--set", "redis.enabled=true"), "apply with redis.enabled=false"),
        (("--set", "redis.external.sentinel.addresses={s1}"), "values don't meet the specifications of the schema"),
    ],
)
def test_external_redis_values_that_would_be_ignored_are_refused(helm, extra, message):
    proc = helm_template(helm, *SENTINEL, *extra, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-600:]


def test_cluster_refuses_wait_replicas(helm):
    proc = helm_template(helm, *CLUSTER, "--set", "redis.external.waitReplicas=1", check=False)
    assert proc.returncode != 0 and "not available on a Redis Cluster" in proc.stderr, proc.stderr[-600:]


def test_probes_are_sized_for_model_loading(rendered):
    for name, r in rendered.items():
        for comp, workload in r.service_workloads().items():
            (c,) = containers(workload)
            startup, live, ready = c["startupProbe"], c["livenessProbe"], c["readinessProbe"]
            assert startup["httpGet"]["path"] == "/healthz" and live["httpGet"]["path"] == "/healthz"
            assert ready["httpGet"]["path"] == "/readyz"
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, f"{name}: {comp} startup budget"
            assert {p["name"] for p in c["ports"]} >= {"grpc", "http"}


def test_rendered_experiment_config_loads(rendered):
    for name, r in rendered.items():
        (cm,) = [c for c in r.kind("ConfigMap") if c["metadata"]["name"].endswith("-experiment")]
        cfg = parse_config(yaml.safe_load(cm["data"]["config.yaml"]), f"{name} ConfigMap")
        expected = "demo" if name == "default" else "llama32-1b-ppo"
        assert cfg.run_id == expected
        for workload in r.service_workloads().values():
            assert env_of(containers(workload)[0])["RLHF_RUN_ID"]["value"] == expected


def test_default_values_config_is_the_demo_config():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    assert values["experiment"]["config"] == demo, "values.yaml's experiment.config drifted from configs/demo.yaml"
    assert parse_config(values["experiment"]["config"]) == load_config(ROOT / "configs" / "demo.yaml")


def _peers(rule: dict) -> list[str]:
    return [
        p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for p in rule.get("from", [])
        if "podSelector" in p
    ]


def _rules_for_port(policy: dict, port: str) -> list[dict]:
    return [r for r in policy["spec"]["ingress"] if any(p["port"] == port for p in r.get("ports", []))]


def test_network_policy_only_trainer_reaches_rollout_grpc_and_admin_ports(rendered):
    r = rendered["default"]
    rollout = r.component("NetworkPolicy", "rollout")
    (grpc_rule,) = _rules_for_port(rollout, "grpc")
    assert _peers(grpc_rule) == ["trainer"] and len(grpc_rule["from"]) == 1
    assert not _rules_for_port(rollout, "http"), "no REST clients listed: nothing but port-forward reaches HTTP"
    trainer = r.component("NetworkPolicy", "trainer")
    assert not _rules_for_port(trainer, "grpc") and not _rules_for_port(trainer, "http"), "admin ports are closed"
    (peer_rule,) = [x for x in trainer["spec"]["ingress"] if "ports" not in x]
    assert _peers(peer_rule) == ["trainer"], "only trainer pods (torchrun) reach the trainer's other ports"
    for comp in ("reward", "reference"):
        (g,) = _rules_for_port(r.component("NetworkPolicy", comp), "grpc")
        assert sorted(_peers(g)) == ["rollout", "trainer"]
    (redis_rule,) = r.component("NetworkPolicy", "redis")["spec"]["ingress"]
    assert sorted(_peers(redis_rule)) == ["rollout", "trainer"]
    for rule in (x for p in r.kind("NetworkPolicy") for x in p["spec"]["ingress"]):
        assert rule.get("from"), "an ingress rule without `from` admits every pod in the cluster"


def test_rollout_weight_data_port_is_open_to_the_trainer_only_and_off_under_tls(rendered, helm):
    r = rendered["default"]
    (c,) = containers(r.component("Deployment", "rollout"))
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["weights-data"]
    assert env_of(c)["RLHF_WEIGHTS_DATA_PORT"]["value"] == str(port)
    (rule,) = _rules_for_port(r.component("NetworkPolicy", "rollout"), "weights-data")
    assert _peers(rule) == ["trainer"]
    for comp in ("reward", "reference"):
        (other,) = containers(r.component("Deployment", comp))
        assert "RLHF_WEIGHTS_DATA_PORT" not in env_of(other)
    # plaintext data plane: off with TLS on (the trainer then streams over gRPC UpdateWeights)
    tls = render(helm, "--set", "tls.enabled=true", "--set", "tls.existingSecret=rlhf-tls")
    (c,) = containers(tls.component("Deployment", "rollout"))
    assert "RLHF_WEIGHTS_DATA_PORT" not in env_of(c) and "weights-data" not in {p["name"] for p in c["ports"]}
    assert not _rules_for_port(tls.component("NetworkPolicy", "rollout"), "weights-data")


def test_tls_gives_the_clients_the_ca(rendered, helm):
    """Issue 17.5: with tls.enabled the services serve TLS, so their clients (rollout -> reward/reference, trainer ->
    rollout) need the CA that signed the peers' certificate: RLHF_TLS_CA from the mounted Secret."""
    for comp, kind in (("rollout", "Deployment"), ("trainer", "Job")):
        (c,) = containers(rendered["default"].component(kind, comp))
        assert "RLHF_TLS_CA" not in env_of(c)
    tls = render(helm, "--set", "tls.enabled=true", "--set", "tls.existingSecret=t", "--set", "tls.caKey=root.pem")
    for comp, kind in (
        ("rollout", "Deployment"),
        ("trainer", "Job"),
        ("reward", "Deployment"),
        ("reference", "Deployment"),
    ):
        (c,) = containers(tls.component(kind, comp))
        env = env_of(c)
        assert env["RLHF_TLS_CERT"]["value"] == "/etc/rlhf-tls/tls.crt"
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["tls"] == "/etc/rlhf-tls"
        if comp in ("rollout", "trainer"):
            assert env["RLHF_TLS_CA"]["value"] == "/etc/rlhf-tls/root.pem", comp
        else:  # servers only: they open no channel to a peer
            assert "RLHF_TLS_CA" not in env, comp


def test_network_policy_opens_listed_peers(helm):
    admin = '{"podSelector": {"matchLabels": {"role": "ops"}}}'
    r = render(helm, "--set-json", f"networkPolicy.adminFrom=[{admin}]")
    trainer = r.component("NetworkPolicy", "trainer")
    (g,) = _rules_for_port(trainer, "grpc")
    assert g["from"] == [json.loads(admin)]


def test_keda_scales_rollout_on_demand(rendered):
    """Jobs the replicas hold (pending entries) plus jobs no replica took yet (the group's lag), per replica slot:
    docs/deploy.md#scaling-signals."""
    r = rendered["gpu"]
    (so,) = r.kind("ScaledObject")
    assert so["spec"]["scaleTargetRef"]["name"] == r.component("Deployment", "rollout")["metadata"]["name"]
    triggers = {t["name"]: t for t in so["spec"]["triggers"]}
    assert set(triggers) == {"held", "waiting"}
    for t in triggers.values():
        assert t["type"] == "redis-streams"
        assert (
            t["metadata"]["stream"] == "rlhf:{llama32-1b-ppo}:prompts" and t["metadata"]["consumerGroup"] == "rollout"
        )
    assert "pendingEntriesCount" in triggers["held"]["metadata"] and "lagCount" in triggers["waiting"]["metadata"]
    modifiers = so["spec"]["advanced"]["scalingModifiers"]
    assert modifiers["formula"] == "held + waiting" and modifiers["metricType"] == "AverageValue"
    assert modifiers["target"] == "8", "a replica's slots: RLHF_ROLLOUT_MAX_INFLIGHT_JOBS's default"
    (auth,) = r.kind("TriggerAuthentication")
    assert all(t["authenticationRef"]["name"] == auth["metadata"]["name"] for t in triggers.values())
    assert "replicas" not in r.component("Deployment", "rollout")["spec"], "KEDA owns the replica count"
    (redis_rule,) = r.component("NetworkPolicy", "redis")["spec"]["ingress"]
    assert any("namespaceSelector" in p for p in redis_rule["from"]), "KEDA's operator must reach Redis"
    assert not rendered["default"].kind("ScaledObject")


def test_keda_rollout_target_follows_the_replicas_slots(helm):
    slots = "RLHF_ROLLOUT_MAX_INFLIGHT_JOBS"
    assert not unknown_env({slots}), "the worker's slot count"
    on = ("--set", "rollout.autoscaling.keda.enabled=true")
    r = render(helm, *on, "--set-json", f'rollout.env=[{{"name": "{slots}", "value": "4"}}]')
    (so,) = r.kind("ScaledObject")
    assert so["spec"]["advanced"]["scalingModifiers"]["target"] == "4"
    r = render(helm, *on, "--set", "rollout.autoscaling.keda.jobsPerReplica=12")
    (so,) = r.kind("ScaledObject")
    assert so["spec"]["advanced"]["scalingModifiers"]["target"] == "12"


KEDA_ALL = (
    "--set",
    "rollout.autoscaling.keda.enabled=true",
    "--set",
    "reward.autoscaling.keda.enabled=true",
    "--set",
    "reference.autoscaling.keda.enabled=true",
    "--set",
    "serviceMonitor.enabled=true",
    "--set",
    "autoscaling.prometheus.serverAddress=http://prometheus-operated.monitoring:9090",
)


def test_keda_scales_reward_and_reference_on_their_calls_in_flight(helm):
    """Stateless services: one prometheus trigger each, on their calls in flight (gRPC and HTTP, whatever the scorer:
    a rule or an HTTP judge has no micro-batcher) averaged over `window`, from the series the chart's ServiceMonitor
    scrapes (job = the Service, the release's namespace); the metric is the one rlhf/serving/metrics.py publishes."""
    r = render(helm, *KEDA_ALL)
    published = (ROOT / "rlhf" / "serving" / "metrics.py").read_text()
    scaled = {so["metadata"]["labels"]["app.kubernetes.io/component"]: so for so in r.kind("ScaledObject")}
    assert set(scaled) == {"rollout", "reward", "reference"}
    for comp in ("reward", "reference"):
        dep = r.component("Deployment", comp)
        assert "replicas" not in dep["spec"], f"{comp}: KEDA owns the replica count"
        spec = scaled[comp]["spec"]
        assert spec["scaleTargetRef"]["name"] == dep["metadata"]["name"]
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        meta = trigger["metadata"]
        assert meta["serverAddress"] == "http://prometheus-operated.monitoring:9090" and meta["threshold"] == "8"
        service = r.component("Service", comp)["metadata"]["name"]
        assert meta["query"] == f'sum(avg_over_time(rlhf_requests_in_flight{{namespace="rlhf",job="{service}"}}[1m]))'
        assert '"rlhf_requests_in_flight"' in published, "the query reads a metric the services publish"
    r = render(
        helm,
        *KEDA_ALL,
        "--set",
        "reward.autoscaling.keda.query=sum(up)",
        "--set",
        "serviceMonitor.enabled=false",
        "--set",
        "reference.autoscaling.keda.enabled=false",
    )
    (reward,) = [so for so in r.kind("ScaledObject") if so["metadata"]["name"].endswith("-reward")]
    assert reward["spec"]["triggers"][0]["metadata"]["query"] == "sum(up)"


def test_scale_checks_driver_applies_the_charts_triggers(helm):
    """make scale-check's driver (tests/cluster/triggers.py) stands in for KEDA: rendered with its values, the chart's
    ScaledObjects have its formula, query and targets, so the run scales on what a cluster would."""
    r = render(helm, *KEDA_ALL, *triggers.CHART_VALUES)
    scaled = {so["metadata"]["labels"]["app.kubernetes.io/component"]: so for so in r.kind("ScaledObject")}
    modifiers = scaled["rollout"]["spec"]["advanced"]["scalingModifiers"]
    assert modifiers["formula"] == triggers.ROLLOUT_FORMULA and modifiers["metricType"] == "AverageValue"
    assert float(modifiers["target"]) == triggers.ROLLOUT_TARGET
    held, waiting = (t["metadata"] for t in scaled["rollout"]["spec"]["triggers"])
    assert "pendingEntriesCount" in held and "lagCount" in waiting  # what QueueStats reads as pending and backlog
    (trigger,) = scaled["reward"]["spec"]["triggers"]
    assert float(trigger["metadata"]["threshold"]) == triggers.REWARD_TARGET
    assert re.fullmatch(
        rf"sum\(avg_over_time\({triggers.REWARD_METRIC}\{{[^}}]*\}}\[{triggers.REWARD_WINDOW}\]\)\)",
        trigger["metadata"]["query"],
    ), trigger["metadata"]["query"]
    assert float(triggers.REWARD_WINDOW.rstrip("s")) == triggers.REWARD_WINDOW_S


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--set", "autoscaling.prometheus.serverAddress="), "needs autoscaling.prometheus.serverAddress"),
        (("--set", "serviceMonitor.enabled=false"), "set serviceMonitor.enabled=true or give reward.autoscaling"),
        (("--set", "reward.autoscaling.keda.minReplicas=0"), "values don't meet the specifications of the schema"),
    ],
)
def test_reward_autoscaling_that_would_not_work_fails_the_render(helm, extra, message):
    proc = helm_template(helm, *KEDA_ALL, *extra, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-600:]


def test_reward_and_reference_renew_their_clients_connections(rendered, helm):
    """One gRPC connection per rollout replica through the ClusterIP Service would stay on the pod it reached first:
    reward and reference end each after RLHF_GRPC_MAX_CONNECTION_AGE_S, so pods added by scaling get calls."""
    for name, r in rendered.items():
        for comp in ("reward", "reference"):
            env = env_of(containers(r.component("Deployment", comp))[0])
            age = env["RLHF_GRPC_MAX_CONNECTION_AGE_S"]["value"]
            assert ServiceSettings.from_env({"RLHF_GRPC_MAX_CONNECTION_AGE_S": age}).grpc_max_connection_age_s == 60
        for comp in ("rollout", "environment", "trainer"):  # an episode stays on its environment pod
            for w in r.workloads():
                if w["metadata"]["labels"]["app.kubernetes.io/component"] == comp:
                    assert "RLHF_GRPC_MAX_CONNECTION_AGE_S" not in env_of(containers(w)[0]), (name, comp)
    r = render(helm, "--set", "settings.grpcMaxConnectionAgeSeconds=null")
    assert "RLHF_GRPC_MAX_CONNECTION_AGE_S" not in env_of(containers(r.component("Deployment", "reward"))[0])


def _grace(r, comp: str) -> tuple[int, list[str] | None]:
    spec = r.component("Deployment", comp)["spec"]["template"]["spec"]
    hook = spec["containers"][0].get("lifecycle", {}).get("preStop")
    return spec["terminationGracePeriodSeconds"], hook["exec"]["command"] if hook else None


def test_grace_periods_and_prestop_follow_the_drain_settings(rendered, helm):
    """SIGKILL must not cut a drain: reward/reference stop their servers within RLHF_SHUTDOWN_GRACE_S (+5 for
    HTTP); a rollout replica then gives its jobs in flight the same grace (+10); each after the preStop sleep that
    takes the pod out of its Services' endpoints, plus 10 s to close the engine and exit."""
    r = rendered["default"]
    grace = 20  # values.yaml settings.shutdownGraceSeconds
    for comp in ("rollout", "reward", "reference"):
        env = env_of(containers(r.component("Deployment", comp))[0])
        assert env["RLHF_SHUTDOWN_GRACE_S"]["value"] == str(grace)
    assert _grace(r, "rollout") == (5 + (grace + 5) + (grace + 10) + 10, ["sleep", "5"])
    assert _grace(r, "reward") == _grace(r, "reference") == (5 + grace + 5 + 10, ["sleep", "5"])
    assert "lifecycle" not in containers(r.component("Job", "trainer"))[0], "the trainer checkpoints on SIGTERM"
    r = render(helm, "--set-json", "settings.shutdownGraceSeconds=2.5", "--set", "settings.preStopSeconds=0")
    assert _grace(r, "rollout") == (3 + 5 + 3 + 10 + 10, None) and _grace(r, "reward") == (3 + 5 + 10, None)
    r = render(helm, "--set", "reward.terminationGracePeriodSeconds=300")
    assert _grace(r, "reward")[0] == 300
    proc = helm_template(helm, "--set", "reference.terminationGracePeriodSeconds=39", check=False)
    assert proc.returncode != 0 and "reference.terminationGracePeriodSeconds 39 is below the 40 s" in proc.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--set", "reward.pdb.minAvailable=1"), "reward.pdb.minAvailable 1 with as few as 1 replica(s)"),
        (
            ("--set", "rollout.autoscaling.keda.enabled=true", "--set", "rollout.pdb.minAvailable=1"),
            "with as few as 1 replica(s) (autoscaling.keda.minReplicas)",
        ),
    ],
)
def test_pdbs_that_no_eviction_can_meet_fail_the_render(helm, extra, message):
    proc = helm_template(helm, *extra, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-600:]


def test_pdbs_follow_the_fewest_replicas(helm):
    r = render(helm, "--set", "reward.replicas=3", "--set", "reward.pdb.minAvailable=2")
    assert r.component("PodDisruptionBudget", "reward")["spec"]["minAvailable"] == 2
    r = render(helm, *KEDA_ALL, "--set", "reference.autoscaling.keda.minReplicas=2")
    for comp in ("rollout", "reward", "reference"):  # maxUnavailable 1 holds at any count KEDA picks
        pdb = r.component("PodDisruptionBudget", comp)
        assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    proc = helm_template(
        helm,
        *KEDA_ALL,
        "--set",
        "reference.autoscaling.keda.minReplicas=2",
        "--set",
        "reference.pdb.minAvailable=2",
        check=False,
    )
    assert proc.returncode != 0 and "reference.pdb.minAvailable 2 with as few as 2" in proc.stderr


def test_service_monitor_scrapes_metrics(rendered):
    (sm,) = rendered["gpu"].kind("ServiceMonitor")
    (ep,) = sm["spec"]["endpoints"]
    assert (ep["port"], ep["path"]) == ("http", "/metrics")
    wanted = sm["spec"]["selector"]["matchLabels"].items()
    selected = [
        s for s in rendered["gpu"].kind("Service") if all(s["metadata"]["labels"].get(k) == v for k, v in wanted)
    ]
    assert sorted(s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected) == sorted(SERVICES)


def test_redis_runs_with_aof_on_a_pvc(rendered):
    sts = rendered["default"].component("StatefulSet", "redis")
    (c,) = containers(sts)
    args = c["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert "--requirepass" in args
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    # started and ready on PONG only (redis-cli exits 0 on NOAUTH / LOADING): compose's check, which
    # test_compose.py::test_redis_healthcheck_passes_on_pong_only runs against those replies
    pong = ["sh", "-c", "redis-cli ping | grep -qx PONG"]
    assert c["startupProbe"]["exec"]["command"] == c["readinessProbe"]["exec"]["command"] == pong


def test_checkpoints_pvc_is_mounted_where_the_config_saves(rendered):
    r = rendered["default"]
    (pvc,) = r.kind("PersistentVolumeClaim")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    sts = r.component("Job", "trainer")
    (c,) = containers(sts)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["checkpoints"] == "/var/lib/rlhf/runs"
    vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    # The image's working directory is /var/lib/rlhf: the demo's relative `runs/demo/checkpoints` lands on the PVC.
    assert load_config(ROOT / "configs" / "demo.yaml").training.save.startswith("runs/")


def test_secrets_are_referenced_not_inlined(helm):
    r = render(helm, "--set", "auth.existingSecret=my-token", "--set", "redis.auth.existingSecret=my-redis")
    assert not r.kind("Secret"), "with existing Secrets the chart renders none"
    env = env_of(containers(r.component("Job", "trainer"))[0])
    assert env["RLHF_API_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "my-token"
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "my-redis"


@pytest.mark.parametrize(
    "bad",
    [
        "rollout.acelerator.type=nvidia",
        "trainer.accelerator.type=tpu",
        "reward.replicas=-1",
        "redis.appendfsync=sometimes",
    ],
)
def test_schema_rejects_bad_values(helm, bad):
    proc = helm_template(helm, "--set", bad, check=False)
    assert proc.returncode != 0, f"--set {bad} was accepted"


def _leaf_paths(node, prefix=()):
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _leaf_paths(v, (*prefix, k))
    else:
        yield prefix


def test_every_value_is_documented_and_in_the_schema():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()

    def resolve(node):
        while "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        return node

    def schema_node(path):
        """The schema of a values path; None inside a free-form object (experiment.config, resources, ...)."""
        node = resolve(schema)
        for key in path:
            props = node.get("properties")
            if props is None:
                return None
            assert key in props, f"values key {'.'.join(path)} is not in values.schema.json"
            node = resolve(props[key])
        return node

    for path in _leaf_paths(values):
        schema_node(path)

    # Every key the schema defines carries a `# --` comment, except blocks whose own keys are documented; below a
    # documented key (resources, strategy, securityContext, ...) the lines are its value, not more keys.
    undocumented, stack = [], []  # stack: (indent, key, documented)
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
            continue
        indent = len(line) - len(stripped)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = stripped.split(":", 1)[0]
        path = (*[k for _, k, _ in stack], key)
        j = i - 1
        while j >= 0 and lines[j].lstrip().startswith("#") and not lines[j].lstrip().startswith("# --"):
            j -= 1
        documented = j >= 0 and lines[j].lstrip().startswith("# --")
        inside_value = any(d for _, _, d in stack)
        stack.append((indent, key, documented))
        if inside_value or documented:
            continue
        node = schema_node(path)
        if node is None or node.get("properties") is not None:
            continue  # free-form content, or a block whose keys are documented
        undocumented.append(f"values.yaml:{i + 1}: {'.'.join(path)}")
    assert not undocumented, "keys without a `# --` comment:\n" + "\n".join(undocumented)


def test_notes_tell_how_to_watch_a_run(helm, tmp_path):
    # `helm template` does not render NOTES.txt and Helm 3's `install --dry-run` wants a cluster: render the notes
    # as a ConfigMap of a copy of the chart.
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "zz-notes.yaml").write_text(
        '{{- define "notes-under-test" }}' + notes + "{{- end }}\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  notes: |\n"
        '    {{- include "notes-under-test" . | nindent 4 }}\n'
    )
    proc = subprocess.run(
        [helm, "template", "rlhf", str(chart), "-n", "rlhf", "--show-only", "templates/zz-notes.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = yaml.safe_load(proc.stdout)["data"]["notes"]
    for needed in (
        "logs -f job/rlhf-rlhf-pipeline-trainer",
        "port-forward svc/rlhf-rlhf-pipeline-rollout",
        "/v1/status",
        "/v1/completions",
        "/v1/score",
        "XPENDING 'rlhf:{demo}:prompts' rollout",
    ):
        assert needed in text, needed


def test_example_values_files_are_valid_yaml_with_documented_header():
    for path in sorted(Path(CHART.parent / "examples").glob("values-*.yaml")):
        text = path.read_text()
        assert text.startswith("#") and "helm install" in text, f"{path.name}: say how to install with it"
        assert parse_docs(text), path


def test_values_schema_is_generated_and_current():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "k8s" / "gen_values_schema.py")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == json.loads((CHART / "values.schema.json").read_text()), (
        "values.schema.json is stale: python k8s/gen_values_schema.py > k8s/rlhf-pipeline/values.schema.json"
    )


@pytest.mark.parametrize(("example", "backend"), [("default", None), ("gpu", "nccl"), ("npu", "tcp")])
def test_weight_sync_transport_per_accelerator(rendered, example, backend):
    """GPU pushes weights by one collective broadcast (nccl), CPU keeps auto (the TCP data plane), NPU streams over
    TCP (collective over hccl between pods needs hostNetwork or a RoCE fabric: test_hccl_collective_*); with
    collective the NetworkPolicy opens every port between trainer and rollout pods (store and gloo/NCCL/HCCL peers
    listen on ephemeral ports), and only then."""
    r = rendered[example]
    (trainer,) = containers(r.component("Job", "trainer"))
    env = env_of(trainer)
    (rollout,) = containers(r.component("Deployment", "rollout"))
    assert "RLHF_WEIGHTS_TRANSPORT" not in env_of(rollout)  # the replica takes the backend from each push
    trainer_np, rollout_np = r.component("NetworkPolicy", "trainer"), r.component("NetworkPolicy", "rollout")
    open_rollout = [x for x in rollout_np["spec"]["ingress"] if "ports" not in x]
    open_trainer = [_peers(x) for x in trainer_np["spec"]["ingress"] if "ports" not in x]
    if backend is None:
        assert "RLHF_WEIGHTS_TRANSPORT" not in env and "RLHF_WEIGHTS_COLLECTIVE_BACKEND" not in env
        assert not open_rollout and open_trainer == [["trainer"]]
        return
    if backend == "tcp":
        assert env["RLHF_WEIGHTS_TRANSPORT"]["value"] == "tcp" and "RLHF_WEIGHTS_COLLECTIVE_BACKEND" not in env
        assert "RLHF_WEIGHTS_DATA_PORT" in env_of(rollout), "tcp needs the rollout's data port"
        assert not open_rollout and open_trainer == [["trainer"]]
        return
    assert env["RLHF_WEIGHTS_TRANSPORT"]["value"] == "collective"
    assert env["RLHF_WEIGHTS_COLLECTIVE_BACKEND"]["value"] == backend
    assert [_peers(x) for x in open_rollout] == [["trainer"]]
    assert sorted(open_trainer) == [["rollout"], ["trainer"]]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--set", "weightSync.collectiveBackend=nccl"), "applies with weightSync.transport=collective only"),
        (
            (
                "--set",
                "weightSync.transport=collective",
                "--set",
                "tls.enabled=true",
                "--set",
                "tls.existingSecret=rlhf-tls",
            ),
            "sends weights in plaintext",
        ),
        (("--set", "weightSync.transport=nccl"), "values don't meet the specifications of the schema"),
    ],
)
def test_weight_sync_values_that_would_be_ignored_or_refused_fail_the_render(helm, extra, message):
    proc = helm_template(helm, *extra, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-600:]


# ---------------------------------------------------------------- Ascend: SoC flavours, HCCL between pods (issue 27)


def _ascend_node_types(pod_spec: dict) -> list[set[str]]:
    """Per required node-selector term, the `accelerator-type In` values it demands (one term: one set)."""
    required = pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    out = []
    for term in required["nodeSelectorTerms"]:
        (expr,) = [e for e in term["matchExpressions"] if e["key"] == "accelerator-type"]
        assert expr["operator"] == "In"
        out.append(set(expr["values"]))
    return out


@pytest.mark.parametrize("soc", ["910b", "a3"])
def test_ascend_soc_picks_the_images_and_the_nodes(helm, soc):
    """Issue 27.6: the A2 images only on A2 nodes, the A3 images only on A3 nodes, both from ascend.soc."""
    r = render(helm, *NPU, "--set", f"ascend.soc={soc}")
    other = ({"910b", "a3"} - {soc}).pop()
    for comp, workload in r.service_workloads().items():
        (c,) = containers(workload)
        assert c["image"] == f"registry.example.com/ml/rlhf-pipeline/{comp}:0.1.0-ascend-{soc}", c["image"]
        spec = workload["spec"]["template"]["spec"]
        assert _ascend_node_types(spec) == [ASCEND_NODE_TYPES[soc]], comp
        assert not ASCEND_NODE_TYPES[other] & set().union(*_ascend_node_types(spec)), f"{comp} admits {other} nodes"
    # CPU components of a mixed release keep the cpu image and no Ascend affinity
    mixed = render(helm, *NPU, "--set", f"ascend.soc={soc}", "--set", "reward.accelerator.type=none")
    (c,) = containers(mixed.component("Deployment", "reward"))
    assert c["image"].endswith(":0.1.0-cpu")
    assert "affinity" not in mixed.component("Deployment", "reward")["spec"]["template"]["spec"]


def test_ascend_node_affinity_is_added_to_the_components_own_terms(helm):
    """A component's own required terms are ORed by Kubernetes: the SoC requirement goes into each of them."""
    own = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                ]
            }
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
    }
    r = render(helm, *NPU, "--set", "ascend.soc=a3", "--set-json", f"rollout.affinity={json.dumps(own)}")
    spec = r.component("Deployment", "rollout")["spec"]["template"]["spec"]
    assert _ascend_node_types(spec) == [ASCEND_NODE_TYPES["a3"]] * 2
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [t["matchExpressions"][0]["values"] for t in terms] == [["a"], ["b"]]
    assert "podAntiAffinity" in spec["affinity"]
    off = render(helm, *NPU, "--set", "ascend.nodeAffinity.enabled=false")
    assert "affinity" not in off.component("Deployment", "rollout")["spec"]["template"]["spec"]


@pytest.mark.parametrize("soc", ["a2", "910", "A3", "910c"])
def test_invalid_ascend_soc_fails_the_render(helm, soc):
    proc = helm_template(helm, *NPU, "--set", f"ascend.soc={soc}", check=False)
    assert proc.returncode != 0 and "/ascend/soc" in proc.stderr, proc.stderr[-600:]  # the schema names the key
    # the template says why even where the schema is skipped
    proc = helm_template(helm, *NPU, "--set", f"ascend.soc={soc}", "--skip-schema-validation", check=False)
    assert proc.returncode != 0 and "must be 910b (Atlas A2) or a3 (Atlas A3)" in proc.stderr, proc.stderr[-600:]


HCCL = ("--set", "weightSync.transport=collective", "--set", "weightSync.collectiveBackend=hccl")
HOSTNET = (
    "--set",
    "weightSync.hostNetwork=true",
    "--set",
    "rollout.replicas=1",
    "--set-json",
    'networkPolicy.nodesFrom=[{"ipBlock": {"cidr": "10.0.0.0/16"}}]',
)
HCCL_REFUSED = "weightSync.transport=collective over hccl needs weightSync.hostNetwork=true or ascend.roce.enabled"


@pytest.mark.parametrize(
    "extra",
    [
        HCCL,
        # auto picks hccl for an Ascend trainer
        ("--set", "weightSync.transport=collective"),
        # an explicit hccl backend is refused whatever the devices
        (*HCCL, "--set", "trainer.accelerator.type=none"),
    ],
)
def test_hccl_collective_between_pods_needs_host_network_or_roce(helm, extra):
    """Issue 27.5: HCCL between two pods with their own IPs sees two servers and needs RoCE (vllm-ascend#14506)."""
    proc = helm_template(helm, *NPU, *extra, check=False)
    assert proc.returncode != 0 and HCCL_REFUSED in proc.stderr, proc.stderr[-600:]
    proc = helm_template(
        helm,
        *NPU,
        "--set",
        "weightSync.transport=collective",
        "--set",
        "weightSync.collectiveBackend=gloo",
        check=False,
    )
    assert proc.returncode == 0, "gloo (host memory) is not HCCL: no network requirement"


def test_hccl_collective_on_the_host_network(helm):
    r = render(helm, *NPU, *HCCL, *HOSTNET)
    trainer_job, rollout = r.component("Job", "trainer"), r.component("Deployment", "rollout")
    for w in (trainer_job, rollout):
        spec = w["spec"]["template"]["spec"]
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert env_of(containers(w)[0])["HCCL_HOST_SOCKET_PORT_RANGE"]["value"] == "auto"
    for comp in ("reward", "reference"):
        spec = r.component("Deployment", comp)["spec"]["template"]["spec"]
        assert "hostNetwork" not in spec and "dnsPolicy" not in spec
        assert "HCCL_HOST_SOCKET_PORT_RANGE" not in env_of(containers(r.component("Deployment", comp))[0])
    # the trainer moves off the rollout's ports on the shared node network; its Service still answers on 50051/8000
    (tc,) = containers(trainer_job)
    ns = parse_container_command(tc["args"])
    assert (ns.grpc_port, ns.http_port) == (50061, 8003)
    assert {p["name"]: p["containerPort"] for p in tc["ports"]} == {"grpc": 50061, "http": 8003, "rendezvous": 29500}
    assert (env_of(tc)["RLHF_GRPC_PORT"]["value"], env_of(tc)["RLHF_HTTP_PORT"]["value"]) == ("50061", "8003")
    assert tc["startupProbe"]["httpGet"]["port"] == "http"
    svc = {p["name"]: (p["port"], p["targetPort"]) for p in r.component("Service", "trainer")["spec"]["ports"]}
    assert svc == {"grpc": (50051, "grpc"), "http": (8000, "http")}
    (rc,) = containers(rollout)
    rollout_ports = {p["containerPort"] for p in rc["ports"]}
    assert rollout_ports == {50051, 8000, 50052} and not rollout_ports & {50061, 8003, 29500}
    assert env_of(rc)["RLHF_GRPC_PORT"]["value"] == "50051"
    # without a RoCE fabric the rollout pod must share the trainer's node (HCCS), next to the SoC's node affinity
    affinity = rollout["spec"]["template"]["spec"]["affinity"]
    (term,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "trainer"
    assert _ascend_node_types(rollout["spec"]["template"]["spec"]) == [ASCEND_NODE_TYPES["910b"]]
    # a replaced trainer pod prefers the rollout's node (required both ways would deadlock the first placement)
    trainer_pod_affinity = trainer_job["spec"]["template"]["spec"]["affinity"]["podAffinity"]
    (pref,) = trainer_pod_affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["podAffinityTerm"]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "rollout"
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in trainer_pod_affinity
    # host-network pods connect from their node's address: every rule admitting trainer or rollout admits the nodes
    node = {"ipBlock": {"cidr": "10.0.0.0/16"}}
    for policy in r.kind("NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            if {"trainer", "rollout"} & set(_peers(rule)):
                assert node in rule["from"], (policy["metadata"]["name"], rule)
    env = env_of(tc)
    assert env["RLHF_WEIGHTS_TRANSPORT"]["value"] == "collective"
    assert env["RLHF_WEIGHTS_COLLECTIVE_BACKEND"]["value"] == "hccl"


def test_hccl_collective_with_a_roce_fabric(helm):
    """ascend.roce.enabled: pods keep the pod network, several replicas are fine, hccn.conf is mounted."""
    r = render(helm, *NPU, *HCCL, "--set", "ascend.roce.enabled=true")
    for comp, w in r.service_workloads().items():
        spec = w["spec"]["template"]["spec"]
        assert "hostNetwork" not in spec
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["hccn-conf"]["hostPath"] == {"path": "/etc/hccn.conf", "type": "File"}, comp
        mounts = {m["name"]: m for m in containers(w)[0]["volumeMounts"]}
        assert mounts["hccn-conf"]["mountPath"] == "/etc/hccn.conf" and mounts["hccn-conf"]["readOnly"], comp
    assert r.component("Deployment", "rollout")["spec"]["replicas"] == 2
    assert "podAffinity" not in r.component("Deployment", "rollout")["spec"]["template"]["spec"]["affinity"]
    # host network and RoCE together: HCCS on the trainer's node, RoCE to the others, so no colocation
    both = render(helm, *NPU, *HCCL, *HOSTNET, "--set", "ascend.roce.enabled=true", "--set", "rollout.replicas=3")
    spec = both.component("Deployment", "rollout")["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and "podAffinity" not in spec["affinity"]
    assert "podAffinity" not in both.component("Job", "trainer")["spec"]["template"]["spec"]["affinity"]
    plain = render(helm, *NPU).component("Job", "trainer")["spec"]["template"]["spec"]
    assert "hccn-conf" not in {v["name"] for v in plain["volumes"]}, "hccn.conf only with ascend.roce.enabled"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--set", "rollout.replicas=2"), "set rollout.replicas=1 and no KEDA"),
        (("--set", "rollout.autoscaling.keda.enabled=true"), "set rollout.replicas=1 and no KEDA"),
        (("--set-json", "networkPolicy.nodesFrom=[]"), "list the nodes in networkPolicy.nodesFrom"),
        (("--set", "trainer.hostNetworkPorts.grpc=50052"), "must differ from each other and from the rollout's"),
        (("--set", "trainer.hostNetworkPorts.http=8000"), "must differ from each other and from the rollout's"),
        (("--set", "trainer.hostNetworkPorts.http=50061"), "must differ from each other and from the rollout's"),
    ],
)
def test_host_network_values_that_would_not_work_fail_the_render(helm, extra, message):
    proc = helm_template(helm, *NPU, *HCCL, *HOSTNET, *extra, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-600:]
    if "nodesFrom" in message:  # without NetworkPolicies there is nothing to admit the nodes to
        render(helm, *NPU, *HCCL, *HOSTNET, *extra, "--set", "networkPolicy.enabled=false")


# ---------------------------------------------------------------- the environment service (multi-turn episodes)

ENV_ON = ("--set", "experiment.config.environment.name=builtin:calculator")


def _environment_objects(r) -> list[dict]:
    return [d for d in r.docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "environment"]


@pytest.fixture(scope="module")
def with_environment(helm):
    """The default values with the config's environment.name set (and its replicas: 2, what `rlhf up` starts)."""
    return render(helm, *ENV_ON, "--set", "experiment.config.environment.replicas=2")


def test_environment_is_off_unless_the_config_sets_one(rendered):
    for name, r in rendered.items():
        assert not _environment_objects(r), f"{name}: the config sets no environment.name, nothing to host"
        assert "RLHF_ENVIRONMENT_ADDR" not in env_of(containers(r.component("Deployment", "rollout"))[0]), name


def test_environment_service_follows_the_config(with_environment):
    r = with_environment
    dep = r.component("Deployment", "environment")
    assert dep["spec"]["replicas"] == 2, "the config's environment.replicas"
    (c,) = containers(dep)
    ns = parse_container_command(c["args"])
    assert (ns.command, ns.service, ns.config) == ("serve", "environment", "/etc/rlhf/config.yaml")
    assert (ns.grpc_port, ns.http_port) == (50051, 8000)
    assert c["image"] == "rlhf-pipeline/environment:0.1.0-cpu"
    env = env_of(c)
    assert "secretKeyRef" in env["RLHF_API_TOKEN"]["valueFrom"], "every call needs the token, from the Secret"
    assert env["RLHF_DEVICE"]["value"] == "cpu" and "RLHF_REDIS_URL" not in env
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["httpGet"]["port"] == "http"
    assert not set(ACCELERATOR.values()) & set(c["resources"].get("limits", {}))
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["experiment"]["configMap"]["name"] == "rlhf-rlhf-pipeline-experiment"
    svc = r.component("Service", "environment")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50051, "http": 8000}
    assert svc["metadata"]["labels"]["rlhf-pipeline/metrics"] == "true", "the ServiceMonitor scrapes it"
    pdb = r.component("PodDisruptionBudget", "environment")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    # the rollout talks to the ClusterIP Service: one connection per replica, so an episode stays on one pod
    rollout = env_of(containers(r.component("Deployment", "rollout"))[0])
    assert rollout["RLHF_ENVIRONMENT_ADDR"]["value"] == "rlhf-rlhf-pipeline-environment.rlhf.svc.cluster.local:50051"
    trainer = env_of(containers(r.component("Job", "trainer"))[0])
    assert "RLHF_ENVIRONMENT_ADDR" not in trainer
    (cm,) = [c for c in r.kind("ConfigMap") if c["metadata"]["name"].endswith("-experiment")]
    assert parse_config(yaml.safe_load(cm["data"]["config.yaml"])).environment.name == "builtin:calculator"
    names = {e for w in r.workloads() for c in containers(w) for e in env_of(c)}
    assert not unknown_env(names)


def test_network_policy_lets_only_rollout_reach_the_environment(with_environment, helm):
    policy = with_environment.component("NetworkPolicy", "environment")
    (grpc_rule,) = _rules_for_port(policy, "grpc")
    assert _peers(grpc_rule) == ["rollout"] and len(grpc_rule["from"]) == 1
    assert not _rules_for_port(policy, "http"), "no REST clients listed"
    assert all(rule.get("from") for rule in policy["spec"]["ingress"])
    listed = render(helm, *ENV_ON, "--set-json", 'networkPolicy.clientsFrom=[{"podSelector": {}}]')
    (http_rule,) = _rules_for_port(listed.component("NetworkPolicy", "environment"), "http")
    assert http_rule["from"] == [{"podSelector": {}}]


def test_environment_values(helm):
    # explicit replicas win over the config's; with an existing ConfigMap the chart cannot read environment.name
    r = render(helm, *ENV_ON, "--set", "environment.replicas=3")
    assert r.component("Deployment", "environment")["spec"]["replicas"] == 3
    r = render(helm, "--set", "experiment.existingConfigMap=my-config", "--set", "environment.enabled=true")
    assert r.component("Deployment", "environment")["spec"]["replicas"] == 1
    assert not _environment_objects(render(helm, "--set", "experiment.existingConfigMap=my-config"))
    # a service of one's own: the user's address, once, and no service of the chart's that nothing would call
    own = ("--set-json", 'rollout.env=[{"name": "RLHF_ENVIRONMENT_ADDR", "value": "envs.example:50051"}]')
    for enabled in ((), ("--set", "environment.enabled=false")):
        r = render(helm, *ENV_ON, *enabled, *own)
        assert not _environment_objects(r)
        (c,) = containers(r.component("Deployment", "rollout"))
        assert [e["value"] for e in c["env"] if e["name"] == "RLHF_ENVIRONMENT_ADDR"] == ["envs.example:50051"]
    # the GPU example's accelerators stay with the model services: the environment runs the CPU image
    r = render(helm, "-f", str(CHART.parent / "examples" / "values-gpu.yaml"), *ENV_ON)
    (c,) = containers(r.component("Deployment", "environment"))
    assert c["image"].endswith("/rlhf-pipeline/environment:0.1.0-cpu")
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert r.component("Deployment", "environment")["spec"]["template"]["spec"].get("nodeSelector") is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--set", "environment.enabled=true"), "sets no environment.name"),
        ((*ENV_ON, "--set", "environment.enabled=false"), "its episodes need an environment service"),
        (
            (*ENV_ON, "--set", "environment.enabled=true", "--set", "rollout.env[0].name=RLHF_ENVIRONMENT_ADDR"),
            "would never call the chart's environment service",
        ),
        (("--set", "environment.accelerator.type=nvidia"), "accelerator"),
    ],
)
def test_environment_values_that_would_launch_nothing_fail_the_render(helm, extra, message):
    proc = helm_template(helm, *extra, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


# ---------------------------------------------------------------- weightSync.delta (RLHF_WEIGHTS_DELTA)


def test_weight_sync_delta_sets_the_trainers_variable(rendered, helm):
    for name, r in rendered.items():
        assert "RLHF_WEIGHTS_DELTA" not in env_of(containers(r.component("Job", "trainer"))[0]), name  # off
    r = render(helm, "--set", "weightSync.delta=auto")
    env = env_of(containers(r.component("Job", "trainer"))[0])
    assert ServiceSettings.from_env({"RLHF_WEIGHTS_DELTA": env["RLHF_WEIGHTS_DELTA"]["value"]}).weights_delta == "auto"
    assert "RLHF_WEIGHTS_DELTA" not in env_of(containers(r.component("Deployment", "rollout"))[0])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--set", "weightSync.transport=collective"), "a collective push always goes in full"),
        (("--set", "trainer.torchrun.nprocPerNode=2"), "applies to a one-process trainer"),
        (("--set", "weightSync.delta=on"), "delta"),
    ],
)
def test_weight_sync_delta_where_it_would_not_apply_fails_the_render(helm, extra, message):
    proc = helm_template(helm, "--set", "weightSync.delta=auto", *extra, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


# ---------------------------------------------------------------- the training service (tinker SDK API)

TRAINING_ON = ("--set", "training.enabled=true", "--set", "training.auth.existingSecret=rlhf-training-tokens")


def _training_objects(r) -> list[dict]:
    return [d for d in r.docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "training"]


def test_training_service_is_off_by_default(rendered):
    for name, r in rendered.items():
        assert not _training_objects(r), name


def test_training_service_on(helm):
    r = render(helm, *TRAINING_ON)
    assert sorted(d["kind"] for d in _training_objects(r)) == [
        "Deployment",
        "NetworkPolicy",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "Service",
    ]
    dep = r.component("Deployment", "training")
    # one process holds the sessions and runs; the RWO checkpoint volume moves to the new pod only after the old one
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    (c,) = containers(dep)
    ns = parse_container_command(c["args"])
    assert (ns.command, ns.service, ns.config) == ("serve", "training", "/etc/rlhf/config.yaml")
    assert (ns.grpc_port, ns.http_port) == (50051, 8000)
    assert c["image"] == "rlhf-pipeline/training:0.1.0-cpu"
    env = env_of(c)
    assert env["RLHF_TRAINING_TOKENS"]["valueFrom"]["secretKeyRef"] == {
        "name": "rlhf-training-tokens",
        "key": "training-tokens",
    }, "the users' keys from their Secret, never from values"
    assert "secretKeyRef" in env["RLHF_API_TOKEN"]["valueFrom"]
    assert env["RLHF_DEVICE"]["value"] == "cpu" and "RLHF_REDIS_URL" not in env
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600, "the model loads"
    # checkpoints (<training.save>/tinker, training.save relative to the working directory) on the service's PVC
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["checkpoints"] == "/var/lib/rlhf/runs"
    (cm,) = [x for x in r.kind("ConfigMap") if x["metadata"]["name"].endswith("-experiment")]
    save = parse_config(yaml.safe_load(cm["data"]["config.yaml"])).training.save
    assert str(Path("/var/lib/rlhf") / save).startswith(mounts["checkpoints"] + "/")
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    pvc = r.component("PersistentVolumeClaim", "training")
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pvc["metadata"]["name"] != r.component("PersistentVolumeClaim", "trainer")["metadata"]["name"]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    svc = r.component("Service", "training")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50051, "http": 8000}
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["metadata"]["labels"]["rlhf-pipeline/metrics"] == "true", "the ServiceMonitor scrapes it"
    assert r.component("PodDisruptionBudget", "training")["spec"]["maxUnavailable"] == 0
    assert r.component("NetworkPolicy", "training")["spec"]["ingress"] == [], "no clients listed: nobody"
    names = {e for w in r.workloads() for c in containers(w) for e in env_of(c)}
    assert not unknown_env(names)


def test_training_service_values(helm):
    listed = render(helm, *TRAINING_ON, "--set-json", 'networkPolicy.clientsFrom=[{"podSelector": {}}]')
    (http_rule,) = _rules_for_port(listed.component("NetworkPolicy", "training"), "http")
    assert http_rule["from"] == [{"podSelector": {}}]
    assert not _rules_for_port(listed.component("NetworkPolicy", "training"), "grpc"), "health only: no callers"
    gpu = render(
        helm,
        *TRAINING_ON,
        "--set",
        "training.accelerator.type=nvidia",
        "--set",
        "training.accelerator.count=2",
        "--set",
        "training.checkpoints.persistence.existingClaim=tinker-ckpts",
    )
    dep = gpu.component("Deployment", "training")
    (c,) = containers(dep)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" and c["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert env_of(c)["RLHF_DEVICE"]["value"] == "cuda" and c["image"].endswith("-cuda")
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == "tinker-ckpts"
    assert not [p for p in gpu.kind("PersistentVolumeClaim") if "training" in p["metadata"]["name"]]
    ephemeral = render(helm, *TRAINING_ON, "--set", "training.checkpoints.persistence.enabled=false")
    vols = {v["name"]: v for v in ephemeral.component("Deployment", "training")["spec"]["template"]["spec"]["volumes"]}
    assert vols["checkpoints"] == {"name": "checkpoints", "emptyDir": {}}


def test_training_service_without_the_users_keys_fails_the_render(helm):
    proc = helm_template(helm, "--set", "training.enabled=true", check=False)
    assert proc.returncode != 0 and "needs training.auth.existingSecret" in proc.stderr, proc.stderr
    proc = helm_template(helm, *TRAINING_ON, "--set", "training.replicas=2", check=False)
    assert proc.returncode != 0 and "replicas" in proc.stderr, "one pod: the schema has no replicas"


def test_the_configs_training_service_switch_is_not_ignored_by_the_chart(helm):
    """training_service.enabled is rlhf up's switch: the chart refuses it unless its own is on too."""
    asks = ("--set", "experiment.config.training_service.enabled=true")
    proc = helm_template(helm, *asks, check=False)
    assert proc.returncode != 0 and "which is rlhf up's switch" in proc.stderr, proc.stderr
    assert render(helm, *asks, *TRAINING_ON).component("Deployment", "training")
