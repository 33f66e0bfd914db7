"""The published OpenAPI contracts against what the services do (issue 28, item 7): schemathesis runs against the
rollout (hf engine), reward (a rule scorer; the tiny reward model with a rule), reference, trainer and environment apps,
in-process over ASGI, on the tiny models.

Each run is what ``schemathesis run`` does (its engine): per operation the documented examples, the coverage phase
(boundary values, missing required fields, wrong types, methods the document does not declare) and bounded,
derandomized fuzzing of valid and invalid requests. Checks: no 5xx; every status, content type, header and body as
documented; valid requests accepted and invalid ones refused; undeclared methods answered 405 with an ``Allow``
header; the token-protected trainer routes refused without the token (and served with it).

A request valid by the schema may still be refused with 400 where JSON Schema cannot state the rule: relations
between fields (``best_of >= n``, one prompt per query) and the served model's vocabulary and context. Only the
operations listed in :data:`MAY_REFUSE_VALID_DATA` may answer valid data with 400, and only for the reasons listed
there (the ``valid_data_refused_for_a_stated_reason`` check).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from fastapi import Depends
from fastapi.testclient import TestClient

from rlhf.config import ExperimentConfig, load_config
from rlhf.local_redis import LocalRedis
from rlhf.serving import ServiceMetrics, ServiceRunner, ServiceSettings, http_token_dependency
from rlhf.serving.http import create_app
from services.environment import http_app as environment_http
from services.environment.engine import EnvironmentEngine
from services.reference import http_app as reference_http
from services.reference.engine import ReferenceEngine
from services.reward import http_app as reward_http
from services.reward.engine import RewardEngine
from services.rollout import http_app as rollout_http
from services.rollout.factory import make_engine
from services.trainer import http_app as trainer_http
from services.trainer.loop import Trainer

schemathesis = pytest.importorskip("schemathesis")

REPO = Path(__file__).resolve().parents[2]
TOKEN = "contract-token"
MAX_EXAMPLES = 25  # per operation and generation mode, in the fuzzing phase

# Service -> operation -> what its 400 may say to a request valid by the schema (see the module docstring).
CONTEXT = r"the context is \d+"
VOCAB = r"outside the vocabulary"
STREAM_OPTIONS = r"stream_options applies to streams only"
GET_REWARD = [r"has \d+ entries for \d+ queries", r"does not start with prompts\[\d+\]"]
MAY_REFUSE_VALID_DATA: dict[str, dict[str, list[str]]] = {
    "rollout": {
        "POST /v1/completions": [
            VOCAB,
            CONTEXT,
            r"best_of \(\d+\) must be at least n",
            r"best_of > n cannot be streamed",
            r"max_tokens: 0 (needs echo|cannot be streamed)",
            STREAM_OPTIONS,
        ],
        "POST /v1/chat/completions": [
            VOCAB,
            CONTEXT,
            r"the chat template refused",
            r"top_logprobs needs logprobs",
            STREAM_OPTIONS,
            r"tool_choice .* is not supported",
            r"only assistant messages carry tool_calls",
        ],
        "POST /v1/generate": [VOCAB, CONTEXT],
    },
    "reward": {"POST /get_reward": GET_REWARD},
    "reward-model": {
        "POST /v1/score": [r"which accepts at most \d+", r"outside the reward model's vocabulary"],
        "POST /get_reward": [*GET_REWARD, r"which accepts at most \d+", r"label is missing"],
    },
    "reference": {"POST /v1/logprobs": [r"outside the vocabulary", r"the reference model's context is \d+"]},
    "trainer": {},
    "environment": {"POST /v1/episodes/reset": [r"is not hosted by this service", r"this service hosts \d+"]},
}
_refusable: dict[str, list[str]] = {}  # MAY_REFUSE_VALID_DATA of the service under test


def _config(may_refuse: dict[str, list[str]]):
    from schemathesis.config import SchemathesisConfig  # noqa: PLC0415 - schemathesis: after the module's importorskip

    # A body over the configured limit is refused (413) whatever it holds.
    positive = ["2xx", "401", "403", "404", "409", "413", "429"]
    negative = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]
    return SchemathesisConfig.from_dict(
        {
            # a rollout request may generate up to the context's length: on 2 loaded cores that took over 10 s
            # (schemathesis's default read timeout) once in a full run
            "request-timeout": 120,
            "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none", "mode": "all"},
            "phases": {
                "examples": {"enabled": True},
                "coverage": {"enabled": True},
                "fuzzing": {"enabled": True},
                "stateful": {"enabled": False},
            },
            "checks": {
                "enabled": False,
                "not_a_server_error": {"enabled": True},
                "status_code_conformance": {"enabled": True},
                "content_type_conformance": {"enabled": True},
                "response_schema_conformance": {"enabled": True},
                "response_headers_conformance": {"enabled": True},
                "positive_data_acceptance": {"enabled": True, "expected-statuses": positive},
                "negative_data_rejection": {"enabled": True, "expected-statuses": negative},
                "missing_required_header": {"enabled": True},
                "unsupported_method": {"enabled": True},
                "ignored_auth": {"enabled": True},
                "valid_data_refused_for_a_stated_reason": {"enabled": True},
            },
            "operations": [
                {"include-name": op, "checks": {"positive_data_acceptance": {"expected-statuses": [*positive, "400"]}}}
                for op in may_refuse
            ],
            "auth": {"openapi": {"bearer": {"bearer": TOKEN}}},
            "workers": 1,
            "output": {"sanitization": {"enabled": False}},  # the reports show the token ids as sent
            "max-failures": 50,
        }
    )


@schemathesis.check
def valid_data_refused_for_a_stated_reason(ctx, response, case):
    """A 400 to valid data says one of the rules JSON Schema cannot state (MAY_REFUSE_VALID_DATA)."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code != 400:
        return None
    message = response.json()["error"]["message"]
    if not any(re.search(p, message) for p in _refusable.get(f"{case.method.upper()} {case.operation.path}", [])):
        raise AssertionError(f"valid data refused with 400 for a rule the schema does not state: {message}")
    return None


def _on_loop(app, start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]) -> None:
    """Start and stop the engine in the app's lifespan: on the event loop schemathesis' ASGI transport serves it on."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await start()
        try:
            yield
        finally:
            await stop()

    app.router.lifespan_context = lifespan


def _settings() -> ServiceSettings:
    return ServiceSettings(api_token=TOKEN, max_body_bytes=1 << 20)


def _rollout_app():
    metrics = ServiceMetrics("rollout")
    engine = make_engine(load_config(REPO / "configs" / "demo.yaml"), kind="hf", device="cpu")
    app = rollout_http.build_app(engine, _settings(), metrics)
    _on_loop(app, engine.start, engine.close)
    return app


def _reward_app(config: str = "demo.yaml"):
    metrics = ServiceMetrics("reward")
    engine = RewardEngine(load_config(REPO / "configs" / config), device="cpu", metrics=metrics)
    app = reward_http.build_app(engine, _settings(), metrics)
    _on_loop(app, engine.start, engine.close)
    return app


def _reference_app():
    metrics = ServiceMetrics("reference")
    engine = ReferenceEngine(load_config(REPO / "configs" / "demo.yaml"), device="cpu", metrics=metrics)
    app = reference_http.build_app(engine, _settings(), metrics)
    _on_loop(app, engine.start, engine.close)
    return app


def _environment_app():
    metrics = ServiceMetrics("environment")
    # Echo (tests/integration/_environments.py) answers any turn; the calculator refuses a reset without a label (400)
    engine = EnvironmentEngine({"python:_environments:Echo": {"turns": 2}}, metrics=metrics)
    app = environment_http.build_app(engine, _settings(), metrics)
    _on_loop(app, engine.start, engine.close)
    return app


def _trainer_app(redis_url: str, run_dir: Path):
    cfg = ExperimentConfig.model_validate(
        {
            "run_id": "contract",
            "training": {
                "stage": "ray_grpo",
                "global_batch_size": 4,
                "train_iters": 1000,
                "save_interval": 1000,
                "device": "cpu",
                "save": str(run_dir / "checkpoints"),
            },
            "actor_rollout_ref": {
                "actor_rollout": {
                    "load": "tiny:policy",
                    "n_samples_per_prompt": 2,
                    "ppo_mini_batch_size": 8,
                    "max_new_tokens": 4,
                }
            },
            "algorithm": {"adv_estimator": "grpo"},
            "reward": {"scorers": [{"type": "rule", "name": "length"}]},
        }
    )
    settings = ServiceSettings(api_token=TOKEN, redis_url=redis_url, run_dir=str(run_dir), max_body_bytes=1 << 20)
    metrics = ServiceMetrics("trainer")
    trainer = Trainer(cfg, settings, ServiceRunner("trainer", settings, metrics))
    app = trainer_http.build_app(trainer, settings, metrics)
    _on_loop(app, trainer.start, trainer.stop)
    return app


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with LocalRedis(tmp_path_factory.mktemp("contract-redis")) as server:
        yield server.url


@pytest.fixture(scope="module")
def lifespans(redis_url):
    """The engines run until the module is done (schemathesis keeps an ASGI app's lifespan open); the trainer stops
    before its Redis does."""
    yield
    from schemathesis.python.asgi import shutdown_lifespans  # noqa: PLC0415 - schemathesis: after the module's importorskip

    shutdown_lifespans()


def _run(app, may_refuse: dict[str, list[str]]) -> tuple[dict[tuple[str, str], str], dict[str, dict[int, int]], int]:
    """One schemathesis run: the distinct failures (operation, check) -> report, the statuses seen per operation,
    and the number of requests sent."""
    from schemathesis.engine import events  # noqa: PLC0415 - schemathesis: after the module's importorskip

    _refusable.clear()
    _refusable.update(may_refuse)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=_config(may_refuse))
    failures: dict[tuple[str, str], str] = {}
    statuses: dict[str, dict[int, int]] = {}
    sent = 0
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            rec = event.recorder
            for interaction in rec.interactions.values():
                if interaction.response is not None:
                    sent += 1
                    seen = statuses.setdefault(rec.label, {})
                    seen[interaction.response.status_code] = seen.get(interaction.response.status_code, 0) + 1
            for case_id, nodes in rec.checks.items():
                for node in nodes:
                    if node.failure_info is None or (rec.label, node.name) in failures:
                        continue
                    interaction = rec.interactions.get(case_id)
                    response = interaction.response if interaction is not None else None
                    got = f"{response.status_code} {response.content[:400]!r}" if response is not None else "nothing"
                    failures[(rec.label, node.name)] = (
                        f"{node.failure_info.failure.message}\n  got: {got}\n  {node.failure_info.code_sample[:800]}"
                    )
        elif isinstance(event, events.NonFatalError | events.FatalError):
            failures[("engine", type(event).__name__)] = str(getattr(event, "value", None) or event.exception)
    return failures, statuses, sent


SERVICES = {
    "rollout": lambda request: _rollout_app(),
    "reward": lambda request: _reward_app(),
    "reward-model": lambda request: _reward_app("reward-tiny-model.yaml"),
    "reference": lambda request: _reference_app(),
    "environment": lambda request: _environment_app(),
    "trainer": lambda request: _trainer_app(
        request.getfixturevalue("redis_url"), request.getfixturevalue("tmp_path") / "run"
    ),
}


@pytest.mark.parametrize("service", list(SERVICES))
def test_openapi_contract(service, request, tiny_models, lifespans):
    t0 = time.monotonic()
    failures, statuses, sent = _run(SERVICES[service](request), MAY_REFUSE_VALID_DATA[service])
    report = "\n\n".join(f"{op} [{check}]\n{text}" for (op, check), text in sorted(failures.items()))
    print(f"\n{service}: {sent} requests in {time.monotonic() - t0:.1f} s; statuses per operation:")
    for op, seen in sorted(statuses.items()):
        print(f"  {op}: {dict(sorted(seen.items()))}")
    assert not failures, f"{len(failures)} contract failure(s) of the {service} service:\n\n{report}"
    # every operation was also answered successfully, so its success body was checked against its schema
    missing = [op for op, seen in statuses.items() if not any(200 <= s < 300 for s in seen)]
    assert not missing, f"never answered 2xx: {missing} (add an example to the request model)"
    assert sent > 10 * len(statuses)


def _component(doc: dict, name: str):
    """A validator for one request schema of a published OpenAPI document."""
    import jsonschema  # noqa: PLC0415 - jsonschema: comes with schemathesis (importorskip at module top)

    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


def test_the_reward_schema_states_what_the_service_refuses(tiny_models):
    """The issue's examples: requests valid by the published schema were refused with an undocumented 400."""
    doc = _reward_app().openapi()
    score = _component(doc, "ScoreRequestIn")
    assert not score.is_valid({"items": [{"prompt": "", "response": "x"}]})
    assert score.is_valid({"items": [{"prompt": "", "prompt_ids": [5], "response": "x"}]})  # ids only: allowed
    assert not score.is_valid({"items": [{"prompt": "p", "response": "r", "response_ids": [1.5]}]})
    assert score.is_valid({"items": [{"prompt": "p", "response": "r", "response_ids": [7.0]}]})  # an integer
    get_reward = _component(doc, "GetRewardIn")
    assert not get_reward.is_valid({"query": ["a b"]})
    assert not get_reward.is_valid({"query": ["a b"], "prompts": [""]})
    assert get_reward.is_valid({"query": ["a b"], "prompts": ["a"]})
    paths = doc["paths"]
    assert set(paths["/v1/score"]["post"]["responses"]) == {"200", "400", "413", "422", "500", "503"}
    assert set(paths["/get_reward"]["post"]["responses"]) == {"200", "400", "413", "422", "500", "503", "504"}
    assert set(paths["/v1/scorers"]["get"]["responses"]) == {"200", "500"}
    error = paths["/v1/score"]["post"]["responses"]["422"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorBody"}  # not FastAPI's {"detail": [...]}
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_405_names_the_allowed_methods_and_protected_routes_document_401_and_403():
    settings = ServiceSettings(api_token=TOKEN)
    app = create_app("toy", settings)

    @app.post("/admin", dependencies=[Depends(http_token_dependency(settings))])
    async def admin() -> dict:
        return {"ok": True}

    with TestClient(app) as client:
        r = client.get("/admin")
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
        assert r.json()["error"] == {
            "type": "method_not_allowed",
            "code": 405,
            "param": None,
            "field": None,
            "message": "method GET is not allowed on /admin; use POST",
        }
        assert client.request("TRACE", "/healthz").headers["allow"] == "GET"
        r = client.post("/admin")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert client.post("/admin", headers={"authorization": f"Bearer {TOKEN}"}).json() == {"ok": True}
        r = client.post("/nowhere")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
    doc = app.openapi()
    op = doc["paths"]["/admin"]["post"]
    assert set(op["responses"]) == {"200", "401", "403", "413", "500"}
    assert op["security"] == [{"bearer": []}]
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "the server's RLHF_API_TOKEN, as 'Authorization: Bearer <token>'",
    }
