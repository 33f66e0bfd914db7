"""``rlhf.models.resolve_model_path``: Hugging Face ids resolve through the hub's cache (a fake cache in the hub's
layout here, offline), and a path that does not exist says so."""

from __future__ import annotations

import shutil

import pytest

from rlhf.models import load_tokenizer, resolve_model_path

REV = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root, repo_id: str, model_dir) -> None:
    """The hub's cache layout: models--org--name/{refs/main, snapshots/<rev>/<files>} (blobs are not needed to read)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    shutil.copytree(model_dir, repo / "snapshots" / REV)


def test_hf_id_resolves_from_the_local_cache_offline(tiny_models, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "tiny-org/Tiny-Policy-0.1B", tiny_models.policy)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # "tiny-org/..." is not a folder here
    path = resolve_model_path("tiny-org/Tiny-Policy-0.1B")
    assert path == cache / "models--tiny-org--Tiny-Policy-0.1B" / "snapshots" / REV
    assert load_tokenizer(path).pad_token_id is not None  # a usable model folder

    with pytest.raises(FileNotFoundError, match="nor in the Hugging Face cache.*HF_HUB_OFFLINE=1"):
        resolve_model_path("tiny-org/Not-Cached")


def test_missing_local_path_says_it_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "no" / "such" / "model"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path("./models/missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model_path(str(tmp_path / "empty"))


def test_existing_local_folder_wins_over_an_id_of_the_same_name(tiny_models, tmp_path, monkeypatch):
    local = tmp_path / "org" / "model"
    shutil.copytree(tiny_models.policy, local)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    assert resolve_model_path("org/model") == local.relative_to(tmp_path)
