"""``write_recipe_cache`` (``fit`` with ``data.hidden_states_cache: auto``, ``cache-hidden-states``) reuses a
complete cache without loading the target's weights, at the directory the loaded target's fingerprint names; an
interrupted cache, a missing shard or another configuration still loads the target and finishes or refuses the
cache as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftkit.cli import DraftkitCLI
from draftkit.generation.hidden_states import write_recipe_cache

REPO = Path(__file__).resolve().parents[2]
RECIPE = "recipes/tiny-debug.yaml"


@pytest.fixture()
def recipe(tmp_path, monkeypatch):
    """(module, set-up datamodule, load counter) of the tiny recipe in a draftkit cache of its own (so the
    default cache directory starts empty); ``counter["loads"]`` counts ``load_target_model`` calls."""
    monkeypatch.setenv("DRAFTKIT_CACHE", str(tmp_path / "draftkit-cache"))
    monkeypatch.chdir(REPO)
    cli = DraftkitCLI(args=["--recipe", RECIPE], run=False)
    cli.datamodule.setup("fit")
    model, counter = cli.model, {"loads": 0}
    real = model.load_target_model

    def counted():
        counter["loads"] += 1
        return real()

    monkeypatch.setattr(model, "load_target_model", counted)
    return model, cli.datamodule, counter


def _forbid_weights(monkeypatch):
    """Any load of the target's weights raises."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the target's weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def _files(root: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.iterdir())}


def test_a_complete_cache_is_reused_without_the_target(recipe, monkeypatch):
    model, dm, counter = recipe
    first = write_recipe_cache(model, dm, "32-true")
    root = Path(first["output"])
    assert counter["loads"] == 1 and first["shards_done"] == 0 and first["shards_todo"] > 0
    assert first["tokens_written"] == first["tokens_total"] > 0
    before = _files(root)
    _forbid_weights(monkeypatch)
    plans = []
    again = write_recipe_cache(model, dm, "32-true", on_plan=plans.append)
    assert counter["loads"] == 1  # not loaded again
    assert again["output"] == first["output"]  # the config-only fingerprint names the same directory
    assert (again["shards_todo"], again["shards_done"], again["tokens"]) == (0, first["shards_todo"], 0)
    assert (again["tokens_written"], again["bytes_written"], again["tokens_total"]) == (0, 0, first["tokens_total"])
    assert again["ranks"] == [{"shards": [], "tokens_written": 0, "bytes_written": 0, "seconds": 0.0}]
    assert [p["shards_todo"] for p in plans] == [0] and plans[0]["output"] == first["output"]
    assert _files(root) == before  # nothing rewritten, the index included
    dry = write_recipe_cache(model, dm, "32-true", dry_run=True)
    assert dry["shards_todo"] == 0 and "tokens_written" not in dry and counter["loads"] == 1
    assert not model.target_handle.loaded
    dm.open_hidden_states(again["output"])  # what fit does next: the reused cache opens and matches the data
    assert len(dm._offline["train"]) == len(dm.train_set) > 0


def test_a_missing_shard_loads_the_target_and_rewrites_only_it(recipe):
    model, dm, counter = recipe
    root = Path(write_recipe_cache(model, dm, "32-true")["output"])
    before = _files(root)
    shard = sorted(root.glob("train-*.safetensors"))[0]
    shard.unlink()
    result = write_recipe_cache(model, dm, "32-true")
    assert counter["loads"] == 2 and (result["shards_todo"], result["tokens_written"]) == (1, result["tokens"])
    after = _files(root)
    assert after[shard.name][0] == before[shard.name][0]  # the same bytes again
    assert {n: v for n, v in after.items() if n not in (shard.name, "index.json")} == \
        {n: v for n, v in before.items() if n not in (shard.name, "index.json")}


def test_an_interrupted_cache_is_finished(recipe):
    model, dm, counter = recipe
    root = Path(write_recipe_cache(model, dm, "32-true")["output"])
    index = json.loads((root / "index.json").read_text())
    (root / "index.json").write_text(json.dumps({**index, "complete": False}))
    result = write_recipe_cache(model, dm, "32-true")
    assert counter["loads"] == 2 and result["shards_todo"] == 0 and result["shards_done"] > 0
    assert json.loads((root / "index.json").read_text()) == index


def test_another_configuration_is_refused_as_before(recipe, tmp_path):
    model, dm, counter = recipe
    out = tmp_path / "cache"
    write_recipe_cache(model, dm, "32-true", output=out)
    model.hparams.aux_layer_ids = [1, 3, 6]
    with pytest.raises(ValueError, match=r"already holds a hidden-state cache for another configuration "
                                         r"\(differs in \['aux_layer_ids'\]\); choose another --output"):
        write_recipe_cache(model, dm, "32-true", output=out)
    model.hparams.aux_layer_ids = None
    index = json.loads((out / "index.json").read_text())
    index["fingerprint"]["tokenizer"] = "f" * 16  # a cache of another tokenizer (or template)
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"differs in \['tokenizer'\]"):
        write_recipe_cache(model, dm, "32-true", output=out)
    assert counter["loads"] == 3  # each mismatch went the old way: the target loaded, then refused
