"""Hub names resolve to what the Hugging Face cache already holds, never a download."""

from __future__ import annotations

from pathlib import Path

import pytest

from twostroke.engine.checkpoints.hub import hub_cache_dir, hub_model
from twostroke.engine.checkpoints.source import ModelLoadError, resolve_model


def snapshot(cache: Path, repository: str, files: list[str], *, commit: str = "abc123") -> Path:
    """A repository's snapshot as the hub's client lays it out, ``refs/main`` naming it."""
    folder = cache / f"models--{repository.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    root = folder / "snapshots" / commit
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"GGUF" if name.endswith(".gguf") else b"{}")
    return root


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    return folder


def test_the_cache_is_where_the_hubs_client_puts_it(tmp_path: Path) -> None:
    assert hub_cache_dir({"HF_HUB_CACHE": "/a/b"}) == Path("/a/b")
    assert hub_cache_dir({"HF_HOME": "/h"}) == Path("/h/hub")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert hub_cache_dir({}) == Path("~/.cache/huggingface/hub").expanduser()


def test_a_folder_a_single_gguf_or_the_tagged_one(cache: Path) -> None:
    folder = snapshot(cache, "Qwen/Qwen3-1.7B", ["config.json", "model.safetensors"])
    assert resolve_model("Qwen/Qwen3-1.7B") == folder
    root = snapshot(
        cache,
        "Qwen/Qwen3-1.7B-GGUF",
        ["Qwen3-1.7B-Q4_K_M.gguf", "Qwen3-1.7B-Q8_0.gguf", "mmproj-Qwen3-F16.gguf"],
    )
    assert resolve_model("Qwen/Qwen3-1.7B-GGUF:q4_k_m") == root / "Qwen3-1.7B-Q4_K_M.gguf"
    assert resolve_model("Qwen/Qwen3-1.7B-GGUF:Q8_0") == root / "Qwen3-1.7B-Q8_0.gguf"
    single = snapshot(cache, "me/tiny-GGUF", ["sub/tiny-F16.gguf", "mmproj-tiny.gguf"])
    assert resolve_model("me/tiny-GGUF") == single / "sub" / "tiny-F16.gguf"


def test_the_current_snapshot_is_the_one_refs_main_names(cache: Path) -> None:
    snapshot(cache, "me/model", ["config.json"], commit="old")
    new = snapshot(cache, "me/model", ["config.json"], commit="new")
    assert resolve_model("me/model") == new


def test_what_the_cache_cannot_answer_is_an_error_that_says_why(cache: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"^me/absent: .*twostroke never downloads: fetch it "
                       r"with `hf download me/absent`"):  # fmt: skip
        resolve_model("me/absent")
    snapshot(cache, "Qwen/Q-GGUF", ["Q-Q4_K_M.gguf", "Q-Q8_0.gguf"])
    with pytest.raises(ModelLoadError, match=r"several GGUF files: name one as Qwen/Q-GGUF:TAG; "
                       r"the snapshot holds Q-Q4_K_M.gguf, Q-Q8_0.gguf"):  # fmt: skip
        resolve_model("Qwen/Q-GGUF")
    with pytest.raises(ModelLoadError, match=r"no GGUF files match 'Q5_K_M'"):
        resolve_model("Qwen/Q-GGUF:Q5_K_M")
    with pytest.raises(ModelLoadError, match=r"several GGUF files match 'Q'"):
        resolve_model("Qwen/Q-GGUF:Q")
    snapshot(cache, "big/B-GGUF", ["B-Q4_K_M-00001-of-00002.gguf", "B-Q4_K_M-00002-of-00002.gguf"])
    with pytest.raises(ModelLoadError, match=r"split in shards .* llama-gguf-split --merge"):
        resolve_model("big/B-GGUF:Q4_K_M")
    snapshot(cache, "me/empty", ["README.md"])
    with pytest.raises(ModelLoadError, match=r"holds neither config.json nor a GGUF model file"):
        resolve_model("me/empty")


def test_only_hub_names_are_looked_up(cache: Path) -> None:
    assert hub_model("model.gguf") is None  # a path, not a hub name
    assert hub_model("../up/model") is None  # no walking out of the cache
    assert hub_model("a/b/c") is None
    with pytest.raises(ModelLoadError, match=r"no such file or directory"):
        resolve_model("model.gguf")
