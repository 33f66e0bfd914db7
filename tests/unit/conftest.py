"""Fixtures for the unit tests: a tiny model set built once per session (no download)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory):
    """``rlhf.tiny`` policy + reward model + tokenizer, built once into a session temp dir (a few seconds)."""
    from rlhf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny"))
