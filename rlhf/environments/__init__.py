"""Environments: multi-turn tasks an episode runs against.

- ``base``: the interface (Environment, Opening, Outcome, EnvironmentFailure, EpisodeInputInvalid);
- ``registry``: names -> factories (``register``, ``register_prefix``, ``resolve``, ``make``);
- ``builtin``: ``builtin:calculator``; ``adapters``: library environments (verifiers, OpenEnv);
- ``client``: the environment service's client; ``wire``: chat messages <-> ``rlhf.v1.ChatMessage``.

The environment service (``services/environment``) hosts them, one instance per episode.
"""
