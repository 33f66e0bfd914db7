"""The vLLM engine settings of ``actor_rollout`` (max_model_len, gpu_memory_utilization, tensor_model_parallel_size,
enforce_eager): validated, overridable from the deployment's environment, and present in the arguments vLLM's engine
is built from (vLLM's own ``EngineArgs``, not a copy of its fields)."""

from __future__ import annotations

import os

import pytest

import services.rollout.main  # noqa: F401 - registers its RLHF_ROLLOUT_* variables in KNOWN_ENV_VARS
from rlhf.config import ConfigError, parse_config
from rlhf.serving.settings import KNOWN_ENV_VARS
from services.rollout.factory import apply_rollout_env, make_engine, vllm_engine_kwargs
from services.rollout.vllm_engine import VllmEngine, set_vllm_env_defaults


def _cfg(engine: str = "vllm", **actor):
    return parse_config(
        {
            "training": {"seq_length": 96},
            "actor_rollout_ref": {"actor_rollout": {"engine": engine, "max_prompt_length": 32, **actor}},
        }
    )


def test_settings_reach_vllm_engine_args(tiny_models):
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    cfg = _cfg(max_model_len=128, gpu_memory_utilization=0.35, tensor_model_parallel_size=2, enforce_eager=False)
    engine = make_engine(cfg, kind="vllm")  # built, not started
    args = engine._engine_args(arg_utils.EngineArgs)
    assert (args.max_model_len, args.gpu_memory_utilization) == (128, 0.35)
    assert (args.tensor_parallel_size, args.enforce_eager) == (2, False)
    assert args.worker_extension_cls  # the project's own arguments are still there


@pytest.mark.parametrize(
    ("setting", "worker_can", "staged"),
    [(None, True, True), (None, False, False), (False, True, False), (True, True, True), (True, False, "refused")],
)
def test_staged_weight_swap_reaches_the_engine_and_is_decided_by_the_worker(tiny_models, setting, worker_can, staged):
    """null stages where the worker can (on this CPU), false never, true refuses to start on a worker that cannot."""
    cfg = _cfg() if setting is None else _cfg(staged_weight_swap=setting)
    engine = make_engine(cfg, kind="vllm")
    assert engine.staged_swap_setting is setting
    engine.weights.features = {"staged_swap": worker_can, "staged_swap_unsupported": "" if worker_can else "no reload"}
    if staged == "refused":
        with pytest.raises(ValueError, match="staged_weight_swap is on but .* cannot stage: no reload"):
            engine.weights.decide_staged_swap()
    else:
        assert engine.weights.decide_staged_swap() is staged


def test_defaults_leave_vllm_defaults():
    kw = vllm_engine_kwargs(_cfg())
    assert kw == {"tensor_parallel_size": 1}  # gpu_memory_utilization: vLLM's; enforce_eager: by device


@pytest.mark.parametrize(
    ("device", "staged", "eager"),
    [("cuda", None, False), ("cuda", False, False), ("cuda", True, True), ("cpu", None, True), ("npu", None, True)],
)
def test_cuda_graphs_by_default_on_cuda_unless_the_staged_swap_is_on(tiny_models, monkeypatch, device, staged, eager):
    """enforce_eager null: CUDA graphs where vLLM's in-place reload keeps them valid (CUDA, no staged swap), eager
    elsewhere; an explicit setting wins."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    monkeypatch.setattr(VllmEngine, "device_type", property(lambda self: device))
    engine = make_engine(_cfg() if staged is None else _cfg(staged_weight_swap=staged), kind="vllm")
    assert engine._engine_args(arg_utils.EngineArgs).enforce_eager is eager
    engine = make_engine(_cfg(enforce_eager=True), kind="vllm")
    assert engine._engine_args(arg_utils.EngineArgs).enforce_eager is True


def test_max_model_len_bounds_the_hf_engine(tiny_models):
    engine = make_engine(_cfg("hf", max_model_len=100), kind="hf", device="cpu")
    assert engine.max_model_len == 100


@pytest.mark.parametrize(
    ("actor", "key"),
    [
        ({"gpu_memory_utilization": 1.5}, "actor_rollout.gpu_memory_utilization"),
        ({"gpu_memory_utilization": 0}, "actor_rollout.gpu_memory_utilization"),
        ({"tensor_model_parallel_size": 0}, "actor_rollout.tensor_model_parallel_size"),
        ({"max_model_len": 1}, "actor_rollout.max_model_len"),
        ({"max_model_len": 64}, "actor_rollout.max_model_len 64 is shorter"),  # < 32 prompt + 64 response
        ({"staged_weight_swap": True, "enforce_eager": False}, "staged_weight_swap needs enforce_eager"),
    ],
)
def test_invalid_values_name_the_key(actor, key):
    with pytest.raises(ConfigError, match=key):
        _cfg(**actor)


@pytest.mark.parametrize(
    "field", ["gpu_memory_utilization", "tensor_model_parallel_size", "enforce_eager", "staged_weight_swap"]
)
def test_vllm_only_fields_are_refused_with_the_hf_engine(field):
    value = {
        "gpu_memory_utilization": 0.5,
        "tensor_model_parallel_size": 2,
        "enforce_eager": False,
        "staged_weight_swap": True,
    }[field]
    with pytest.raises(ConfigError, match=f"{field} is read by the vllm engine only"):
        _cfg("hf", **{field: value})


def test_a_mindspeed_tensor_parallel_size_of_1_runs_on_the_hf_engine():
    # what the hf engine does anyway (one unsharded model): seed 004's tensor_model_parallel_size: 1 is no error
    assert _cfg("hf", tensor_model_parallel_size=1).actor.tensor_model_parallel_size == 1


def test_environment_overrides_reach_the_engine_args():
    cfg = _cfg(gpu_memory_utilization=0.9)
    env = {"RLHF_ROLLOUT_GPU_MEMORY_UTILIZATION": "0.4", "RLHF_ROLLOUT_MAX_MODEL_LEN": "200"}
    got = apply_rollout_env(cfg, env)
    assert vllm_engine_kwargs(got)["gpu_memory_utilization"] == 0.4 and got.actor.max_model_len == 200
    assert cfg.actor.gpu_memory_utilization == 0.9  # the loaded config is not changed
    assert apply_rollout_env(cfg, {"RLHF_ROLLOUT_MAX_MODEL_LEN": ""}) is cfg  # empty: unset (compose's default)
    with pytest.raises(
        ConfigError, match="(?s)RLHF_ROLLOUT_GPU_MEMORY_UTILIZATION=2.*actor_rollout.gpu_memory_utilization"
    ):
        apply_rollout_env(cfg, {"RLHF_ROLLOUT_GPU_MEMORY_UTILIZATION": "2"})

    assert {"RLHF_ROLLOUT_GPU_MEMORY_UTILIZATION", "RLHF_ROLLOUT_MAX_MODEL_LEN"} <= set(KNOWN_ENV_VARS)


@pytest.mark.parametrize(("device", "spawn"), [("cuda", True), ("npu", True), ("cpu", False)])
def test_workers_spawn_on_accelerators(monkeypatch, device, spawn):
    for var in (
        "VLLM_WORKER_MULTIPROC_METHOD",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "TORCH_COMPILE_DISABLE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    set_vllm_env_defaults(device)

    assert (os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn") is spawn


def test_partial_rollouts_reach_both_engines_and_are_refused_with_adapter_pushes(tiny_models):
    """actor_rollout.partial_rollouts: off by default, on in the hf and vllm engines built from the config; refused
    with LoRA adapter pushes (an adapter push does not pause generation: nothing to interrupt), by the config and by
    the vllm engine itself."""
    for kind in ("hf", "vllm"):
        assert make_engine(_cfg(kind), kind=kind).partial_rollouts is False
        assert make_engine(_cfg(kind, partial_rollouts=True), kind=kind).partial_rollouts is True
    with pytest.raises(ConfigError, match="partial_rollouts with an adapter-only push"):
        _cfg("vllm", partial_rollouts=True, lora_r=4)
    with pytest.raises(ValueError, match="an adapter push does not pause generation"):
        make_engine(_cfg("vllm", lora_r=4), kind="vllm", partial_rollouts=True)
