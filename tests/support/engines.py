"""A rollout engine for one test: ``run_hf(tiny_models, body)`` starts an hf engine on the tiny policy, awaits
``body(engine)`` and closes it (imports torch through the engine: ``from tests.support.engines import run_hf``)."""

from __future__ import annotations

import asyncio

from services.rollout.hf_engine import HFEngine


def run_hf(tiny_models, body, **kw):
    """Start an hf engine (``kw``: its keyword arguments), run ``await body(engine)``, close it; ``body``'s result."""

    async def main():
        eng = HFEngine(tiny_models.policy, "tiny:policy", device="cpu", **kw)
        await eng.start()
        try:
            return await body(eng)
        finally:
            await eng.close()

    return asyncio.run(main())
