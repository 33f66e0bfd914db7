"""Validate the chart's KEDA objects (ScaledObject, TriggerAuthentication) read from stdin (`helm template` output).

kubernetes-validate knows no CRDs, so `make deploy-check` pipes the renders with KEDA on through this script, run by
the tools venv (.venv-tools). Two layers:

1. The CRD schema. KEDA's CRDs are not served by a registry this project reaches; the PyPI package
   cloudcoil-models-keda (Makefile DEPLOY_TOOL_PKGS) holds pydantic models generated from KEDA 2.16's CRDs. Their
   JSON Schema (``model_json_schema``) is what the API server checks, with every object closed
   (``additionalProperties: false``), as `kubectl apply`'s strict field validation does: a misspelt field fails.
2. Each trigger's metadata, which the CRD leaves a free map of strings and KEDA's operator parses at run time: the
   keys of the scalers the chart uses, from KEDA 2.16's scaler docs (keda.sh/docs/2.16/scalers/redis-streams,
   redis-sentinel-streams, redis-cluster-streams, prometheus), one redis-streams metric per trigger, and
   ``advanced.scalingModifiers.formula`` naming only triggers that exist.

Prints one line per object; exit status 1 with the errors when one is invalid, 2 when stdin holds no KEDA object
(a render that was meant to have some).
"""

from __future__ import annotations

import re
import sys
from typing import Any

import jsonschema
import yaml
from cloudcoil.models.keda import v1alpha1 as keda

REDIS_COMMON = {
    "stream",
    "consumerGroup",
    "pendingEntriesCount",
    "streamLength",
    "lagCount",
    "activationLagCount",
    "activationStreamLength",
    "usernameFromEnv",
    "passwordFromEnv",
    "enableTLS",
    "unsafeSsl",
}
METADATA_KEYS = {
    "redis-streams": REDIS_COMMON | {"address", "host", "port", "databaseIndex"},
    "redis-sentinel-streams": REDIS_COMMON
    | {
        "addresses",
        "hosts",
        "ports",
        "databaseIndex",
        "sentinelMaster",
        "sentinelMasterFromEnv",
        "sentinelUsernameFromEnv",
        "sentinelPasswordFromEnv",
    },
    "redis-cluster-streams": REDIS_COMMON | {"addresses", "hosts", "ports"},
    "prometheus": {
        "serverAddress",
        "query",
        "queryParameters",
        "threshold",
        "activationThreshold",
        "namespace",
        "customHeaders",
        "ignoreNullValues",
        "unsafeSsl",
        "timeout",
        "authModes",
    },
}
REQUIRED_KEYS = {
    "redis-streams": {"stream"},
    "redis-sentinel-streams": {"stream", "addresses"},
    "redis-cluster-streams": {"stream", "addresses"},
    "prometheus": {"serverAddress", "query", "threshold"},
}
REDIS_METRICS = ("pendingEntriesCount", "streamLength", "lagCount")


def closed(node: Any) -> Any:
    """The schema with every object that lists its properties closed to others (maps keep their value schema)."""
    if isinstance(node, dict):
        out = {k: closed(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [closed(v) for v in node]
    return node


VALIDATORS = {
    kind: jsonschema.Draft202012Validator(closed(model.model_json_schema(by_alias=True, mode="validation")))
    for kind, model in (("ScaledObject", keda.ScaledObject), ("TriggerAuthentication", keda.TriggerAuthentication))
}


def trigger_errors(spec: dict) -> list[str]:
    errors = []
    names = set()
    for i, t in enumerate(spec.get("triggers") or []):
        kind, meta = t.get("type"), t.get("metadata") or {}
        names.add(t.get("name"))
        if kind not in METADATA_KEYS:
            errors.append(f"triggers[{i}]: type {kind!r} is not one this check knows ({', '.join(METADATA_KEYS)})")
            continue
        unknown = set(meta) - METADATA_KEYS[kind]
        if unknown:
            errors.append(f"triggers[{i}] ({kind}): unknown metadata {sorted(unknown)}")
        missing = REQUIRED_KEYS[kind] - set(meta)
        if missing:
            errors.append(f"triggers[{i}] ({kind}): missing metadata {sorted(missing)}")
        if kind.startswith("redis"):
            metrics = [m for m in REDIS_METRICS if m in meta]
            if len(metrics) != 1:
                errors.append(f"triggers[{i}] ({kind}): needs exactly one of {REDIS_METRICS}, has {metrics}")
    modifiers = (spec.get("advanced") or {}).get("scalingModifiers")
    if modifiers:
        used = set(re.findall(r"[A-Za-z_][A-Za-z0-9_-]*", modifiers.get("formula", "")))
        if None in names or not used <= names:
            errors.append(
                f"scalingModifiers.formula uses {sorted(used)}; the triggers are named {sorted(map(str, names))}"
            )
        if not modifiers.get("target"):
            errors.append("scalingModifiers needs a target")
    return errors


def main() -> int:
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d and d.get("apiVersion", "").startswith("keda.sh/")]
    if not docs:
        print("keda_check: no KEDA object in the input", file=sys.stderr)
        return 2
    bad = 0
    for d in docs:
        name = f"{d['kind']}/{d['metadata']['name']}"
        validator = VALIDATORS.get(d["kind"])
        if validator is None:
            print(f"{name}: no schema for this kind")
            bad += 1
            continue
        errors = [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in validator.iter_errors(d)]
        if d["kind"] == "ScaledObject":
            errors += trigger_errors(d.get("spec") or {})
        print(f"{name}: {'ok' if not errors else 'INVALID'}")
        for e in errors:
            print(f"  {e}")
        bad += bool(errors)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
