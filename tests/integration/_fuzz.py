"""Property-based fuzzing of a live service from its OpenAPI document (schemathesis + hypothesis).

For every operation in ``/openapi.json`` it generates schema-conforming bodies (positive) and, for POST operations,
schema-violating ones (negative: wrong types, missing or unknown fields, out-of-range values), sends them, and fails
on any 5xx answer (schemathesis' ``not_a_server_error`` check). Bounded by ``max_examples`` per operation and mode.
"""

from __future__ import annotations

import contextlib

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error


def fuzz_openapi(base_url: str, max_examples: int = 30, skip: tuple[str, ...] = ()) -> int:
    """Fuzz every operation; return the number of requests sent. Raises on the first 5xx (with the reproducer)."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    sent = 0
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path in skip:
            continue
        modes = [GenerationMode.POSITIVE]
        if op.method.upper() == "POST":
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(
                max_examples=max_examples,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            def run(case):
                nonlocal sent
                sent += 1
                case.call_and_validate(base_url=base_url, checks=[not_a_server_error], timeout=30)

            with contextlib.suppress(Unsatisfiable):  # an operation with nothing to vary in this mode
                run()
    return sent
