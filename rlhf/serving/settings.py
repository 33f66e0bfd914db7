"""Service settings from ``RLHF_*`` environment variables (CLI flags override them).

The experiment config (``--config``) says *what* to run; these settings say *where and how* to serve it, so the same
image runs under docker compose, Helm and ``rlhf up``. ``KNOWN_ENV_VARS`` lists every variable the project reads;
the deployment tests check that the chart sets nothing else, and start-up warns about unknown ``RLHF_*`` names
(a typo such as ``RLHF_GRPC_PROT`` would otherwise be silently ignored).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict

log = logging.getLogger("rlhf.serving")

ENV_PREFIX = "RLHF_"
MiB = 1024 * 1024


_ENV: ContextVar[Mapping[str, str] | None] = ContextVar("rlhf_settings_env", default=None)


class _Environment(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of ``os.environ`` (deployment checks
    validate a compose file's or a chart's environment without exporting it)."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]):
        self._env = env
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:  # the one hook the source reads its variables through
        return {k.lower(): v for k, v in self._env.items()}  # as os.environ is read: names case-insensitive


class ServiceSettings(BaseSettings):
    """Where and how one service process serves. Field ``x`` comes from ``RLHF_X``."""

    # CLI flags (init values) win over the environment; no .env file or secrets folder is read
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_assignment=True)

    host: str = Field("0.0.0.0", description="address both servers bind")
    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port (0: any free port)")
    http_port: int = Field(8000, ge=0, le=65535, description="HTTP (REST) port (0: any free port)")
    api_token: str | None = Field(None, repr=False, description="bearer token for weight sync and admin calls")
    config: str | None = Field(None, description="experiment config YAML (also --config)")
    tls_cert: str | None = Field(None, description="PEM certificate: serve gRPC and HTTP over TLS (with tls_key)")
    tls_key: str | None = Field(None, repr=False, description="PEM private key for tls_cert")
    tls_ca: str | None = Field(
        None,
        description="PEM CA bundle that signs the peers' certificates: this service's gRPC and HTTP clients "
        "(rollout -> reward/reference, trainer -> rollout, rlhf up -> /readyz) then use TLS; without it they use TLS "
        "with the system roots when this service serves TLS, else plaintext",
    )
    max_message_bytes: int = Field(64 * MiB, gt=0, description="largest gRPC message received (and sent)")
    max_body_bytes: int = Field(8 * MiB, gt=0, description="largest HTTP request body; larger gets 413")
    shutdown_grace_s: float = Field(10.0, ge=0, description="seconds in-flight requests get after SIGTERM")
    grpc_max_connection_age_s: float | None = Field(
        None,
        gt=0,
        description="close each gRPC client connection after about this many seconds (GOAWAY; calls in flight finish): "
        "clients reconnect through the Service, so replicas that autoscaling adds get their share of long-lived "
        "clients; unset: connections stay",
    )
    http_header_timeout_s: float = Field(
        10.0, gt=0, description="seconds an HTTP client has to send a request's line and headers (slow: closed, 408)"
    )
    http_body_timeout_s: float = Field(
        60.0, gt=0, description="seconds an HTTP client has to send a request's body once its headers arrived"
    )
    log_level: str = Field("info", description="debug, info, warning, error")
    device: str | None = Field(None, description="override the config's device: auto, cpu, cuda, npu")
    redis_url: str | None = Field(
        None,
        repr=False,
        description="redis://[:password@]host:port/db, redis+sentinel://[:password@]host:port,.../service[/db] or "
        "redis+cluster://[:password@]host:port,... (rediss* for TLS; ?wait_replicas=N: docs/redis-ha.md)",
    )
    run_id: str | None = Field(None, description="override the config's run_id (names the Redis keys)")
    reward_addr: str | None = Field(None, description="host:port of the reward service's gRPC server")
    reference_addr: str | None = Field(None, description="host:port of the reference service's gRPC server")
    environment_addr: str | None = Field(
        None, description="host:port of the environment service's gRPC server (multi-turn episodes)"
    )
    rollout_addrs: Annotated[list[str], NoDecode] = Field(
        [], description="host:port of each rollout replica's gRPC server (comma list)"
    )
    replica_id: str | None = Field(None, description="this replica's name (default: hostname-pid)")
    weights_data_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="rollout: TCP port of the weight-sync data plane (raw bytes beside gRPC; 0: any free port); "
        "off when unset or with TLS (it is plaintext; weights then go over gRPC UpdateWeights)",
    )
    run_dir: str | None = Field(None, description="run folder for metrics.jsonl and checkpoints (rlhf up sets it)")
    weights_transport: Literal["auto", "tcp", "grpc", "collective"] = Field(
        "auto",
        description="trainer: how pushed weights travel (control is always authenticated gRPC): auto (each replica's "
        "TCP data plane when it offers one, else the UpdateWeights stream), tcp, grpc, or collective (one broadcast "
        "to every replica; plaintext like tcp, so refused with TLS)",
    )
    weights_collective_backend: Literal["auto", "gloo", "nccl", "hccl"] = Field(
        "auto",
        description="trainer, with weights_transport=collective: the group's backend, sent to every replica in the "
        "push (a replica that cannot run it refuses): auto (by the trainer's device: gloo on cpu, nccl on cuda, hccl "
        "on npu), gloo (host memory, any device), nccl, hccl",
    )

    model_process: bool = Field(
        True,
        description="reward and reference: the model and its forward in a child process of its own, beside the "
        "serving loop instead of under its GIL (rlhf.serving.model_process); false: in a thread of this process",
    )
    model_threads: int | None = Field(
        None,
        ge=1,
        description="reward, reference and the rollout's hf engine: torch threads of the model's forward (default: "
        "one fewer than OMP_NUM_THREADS, else than the cores, at least 1: the serving loop keeps a core)",
    )
    weights_delta: Literal["auto", "off"] = Field(
        "off",
        description="trainer: delta pushes (docs/weight-sync.md#delta-pushes): auto (a one-process trainer sends each "
        "replica only the 16-bit words that changed since the update it holds, when smaller, over tcp or grpc; the "
        "full update to a replica without that base; costs a copy of the last update on the trainer and on each "
        "replica) or off",
    )

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        env = _ENV.get()  # from_env(env=...): that mapping instead of os.environ
        return (init_settings, env_settings if env is None else _Environment(settings_cls, env))

    @field_validator("rollout_addrs", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [a.strip() for a in v.split(",") if a.strip()]
        return v

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.lower()
        if v not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError("must be debug, info, warning, error or critical")
        return v

    @field_validator(
        "tls_cert",
        "tls_key",
        "tls_ca",
        "api_token",
        "config",
        "device",
        "redis_url",
        "run_id",
        "replica_id",
        "reward_addr",
        "reference_addr",
        "environment_addr",
        "run_dir",
        "weights_data_port",
        mode="before",
    )
    @classmethod
    def _empty_is_none(cls, v: Any) -> Any:
        return None if v == "" else v

    @field_validator("weights_delta", mode="before")
    @classmethod
    def _delta(cls, v: Any) -> Any:
        return "off" if v in ("", None) else str(v).strip().lower()

    @field_validator("weights_transport", "weights_collective_backend", mode="before")
    @classmethod
    def _transport(cls, v: Any) -> Any:
        return "auto" if v in ("", None) else str(v).strip().lower()

    @model_validator(mode="after")
    def _plaintext_transport_needs_no_tls(self) -> ServiceSettings:
        if self.weights_transport in ("tcp", "collective") and self.tls:
            raise ValueError(
                f"RLHF_WEIGHTS_TRANSPORT={self.weights_transport} sends weights in plaintext and this "
                "service serves TLS: use auto or grpc"
            )
        if self.weights_collective_backend != "auto" and self.weights_transport != "collective":
            raise ValueError(
                f"RLHF_WEIGHTS_COLLECTIVE_BACKEND={self.weights_collective_backend} only applies with "
                f"RLHF_WEIGHTS_TRANSPORT=collective (it is {self.weights_transport})"
            )
        return self

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert and self.tls_key)

    @property
    def client_tls(self) -> bool:
        """Whether this service's clients connect to peers over TLS: a ring runs TLS everywhere or nowhere."""
        return bool(self.tls_ca) or self.tls

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ServiceSettings:
        """Read ``RLHF_*`` from ``env`` (default ``os.environ``); ``overrides`` (CLI flags) win; ``None`` means unset.

        Raises ``ValueError`` naming the variable when a value is invalid.
        """
        flags = {k: v for k, v in overrides.items() if v is not None}
        token = _ENV.set(env)
        try:
            settings = cls(**flags)
        except ValidationError as err:
            lines = []
            for e in err.errors():
                name = str(e["loc"][0]) if e["loc"] else "?"
                src = "flag --" + name.replace("_", "-") if name in overrides else ENV_PREFIX + name.upper()
                lines.append(f"{src}: {e['msg']}")
            raise ValueError("invalid service settings: " + "; ".join(lines)) from None
        finally:
            _ENV.reset(token)
        if bool(settings.tls_cert) != bool(settings.tls_key):
            raise ValueError("invalid service settings: set both RLHF_TLS_CERT and RLHF_TLS_KEY (or neither)")
        return settings


# Variables read outside ServiceSettings (documented where they are used).
LIBRARY_ENV_VARS = (
    "RLHF_CACHE_DIR",  # rlhf.models: where tiny models are built
    "RLHF_ROLLOUT_ENGINE",  # services.rollout: vllm | hf, overrides actor_rollout.engine
    "RLHF_ROLLOUT_GPU_MEMORY_UTILIZATION",  # services.rollout: overrides actor_rollout.gpu_memory_utilization
    "RLHF_ROLLOUT_MAX_MODEL_LEN",  # services.rollout: overrides actor_rollout.max_model_len
    "RLHF_ROLLOUT_MAX_INFLIGHT_JOBS",  # services.rollout.worker: prompt jobs in flight per replica
    "RLHF_ROLLOUT_RECLAIM_IDLE_S",  # services.rollout.worker: claim jobs a dead replica left pending this long
    "RLHF_ROLLOUT_RPC_TIMEOUT_S",  # services.rollout.worker: deadline of reward/reference calls
    "RLHF_ROLLOUT_MAX_ADAPTERS",  # services.rollout: named adapters an hf replica holds (LoadAdapter), default 8
    "RLHF_ROLLOUT_CATCH_UP_WAIT_S",  # services.rollout.worker: wait for the trainer's push before taking jobs behind
    "RLHF_WEIGHTS_INPLACE_LOAD_BYTES",  # services.rollout.vllm_weights: updates this large load in place as they arrive
    "RLHF_TRAINING_TOKENS",  # services.training: more users' tokens beside RLHF_API_TOKEN (comma-separated)
    "RLHF_TRAINING_SESSION_TTL_S",  # services.training: unload a session's runs after this long without a heartbeat
)

# Every RLHF_* variable the project reads: one list, in place (register_env_var appends to it), so every importer
# sees the same contents. Deployment files must set nothing else.
KNOWN_ENV_VARS: list[str] = [ENV_PREFIX + n.upper() for n in ServiceSettings.model_fields] + list(LIBRARY_ENV_VARS)


def register_env_var(name: str) -> None:
    """Let another module declare a variable it reads (so start-up does not warn about it). Prefer adding it to
    ``LIBRARY_ENV_VARS`` above, so the deployment checks know it without importing that module."""
    if not name.startswith(ENV_PREFIX):
        raise ValueError(f"{name} must start with {ENV_PREFIX}")
    if name not in KNOWN_ENV_VARS:
        KNOWN_ENV_VARS.append(name)


def unknown_env_vars(env: Mapping[str, str] | None = None) -> list[str]:
    """``RLHF_*`` variables set in ``env`` that nothing reads (typos, stale deployment values)."""
    env = os.environ if env is None else env
    ignore = ("RLHF_TEST_", "RLHF_PARITY_")  # test-suite knobs
    return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in KNOWN_ENV_VARS and not k.startswith(ignore))


def warn_unknown_env_vars(env: Mapping[str, str] | None = None) -> list[str]:
    unknown = unknown_env_vars(env)
    for k in unknown:
        log.warning("unknown environment variable %s is ignored (known: %s)", k, ", ".join(KNOWN_ENV_VARS))
    return unknown


def configure_logging(level: str = "info") -> None:
    """One-line log format for every service process."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger().setLevel(getattr(logging, level.upper(), logging.INFO))
