"""Library adapters, registered as prefixes (see :mod:`rlhf.environments.registry`):

- ``verifiers:<taskset-id>``: a ``verifiers`` 0.4 environment (:mod:`.verifiers_env`);
- ``openenv:<http-url>``: an OpenEnv environment server (:mod:`.openenv_env`).

Both libraries are optional (``pip install 'rlhf-pipeline[envs]'`` style extras live in the Makefile's
``.venv-envs``): resolving a spec only checks its form; the library is imported when an episode starts.
"""

from __future__ import annotations

from rlhf.environments.adapters import openenv_env, verifiers_env
from rlhf.environments.registry import UnknownEnvironment, register_prefix


def _verifiers(rest: str):
    try:
        return verifiers_env.factory(rest)
    except ValueError as err:
        raise UnknownEnvironment(str(err)) from None


def _openenv(rest: str):
    try:
        return openenv_env.factory(rest)
    except ValueError as err:
        raise UnknownEnvironment(str(err)) from None


register_prefix("verifiers", _verifiers)
register_prefix("openenv", _openenv)
