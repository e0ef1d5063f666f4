"""Offline hidden-state cache: round trip, resumable and atomic writing, disk check, bad caches named,
offline training equal to online training (within bf16 storage) and exact offline resume."""

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftkit.artifacts import resolve_artifact
from draftkit.cli import DraftkitCLI
from draftkit.data.collate import collate_offline
from draftkit.data.hidden_cache import HiddenStateCache, bytes_per_token, plan_shards
from draftkit.generation.hidden_states import write_hidden_states
from draftkit.target.lm_head import TargetLMHead

REPO = Path(__file__).resolve().parents[2]
RECIPE = "recipes/tiny-debug.yaml"
FP = {"target": "t", "target_config": "c", "target_dtype": "bfloat16", "aux_layer_ids": [1, 2], "tokenizer": "k", "data": "d"}
H = 4  # H_t of the fake target; 2 aux layers -> aux width 8


def _rows(n=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = int(torch.randint(2, 12, (1,), generator=gen))
        out.append({"input_ids": torch.randint(0, 50, (t,), generator=gen).tolist(),
                    "loss_mask": torch.randint(0, 2, (t,), generator=gen).tolist()})
    return out


def _fake_forward(ids, attn):
    """States that are exact in bf16 and depend on the token and its position: aux = id/2 + j, last = t - id."""
    b, t = ids.shape
    aux = (ids[..., None] * 0.5 + torch.arange(8)) * attn[..., None]  # (B, T, 8)
    last = (-ids[..., None].float()).expand(b, t, H) + torch.arange(t)[None, :, None]  # (B, T, H)
    return aux, last


def _write(out, rows, **kw):
    return write_hidden_states(out, {"train": rows, "val": rows[:2]}, FP, _fake_forward, H, 2, batch_size=3,
                               shard_tokens=20, **kw)


def test_plan_shards():
    assert plan_shards([5, 5, 5, 30, 1], "train", 12) == [
        {"file": "train-00000.safetensors", "rows": [0, 2], "num_tokens": 10},
        {"file": "train-00001.safetensors", "rows": [2, 3], "num_tokens": 5},
        {"file": "train-00002.safetensors", "rows": [3, 4], "num_tokens": 30},  # a long sequence: own shard
        {"file": "train-00003.safetensors", "rows": [4, 5], "num_tokens": 1},
    ]
    assert bytes_per_token(576, 3) == 2 * 4 * 576 + 5  # SmolLM2 default: 4613 bytes per token


def test_round_trip_and_collate(tmp_path):
    rows = _rows()
    plan = _write(tmp_path / "c", rows)
    assert plan["tokens_written"] == plan["tokens_total"] == sum(len(r["input_ids"]) for r in rows) + sum(
        len(r["input_ids"]) for r in rows[:2])
    assert plan["bytes_per_token"] == 2 * 3 * H + 5
    cache = HiddenStateCache(tmp_path / "c")
    ds = cache.dataset("train")
    assert len(ds) == 9 and len(cache.shards("train")) > 1
    for i, r in enumerate(rows):
        ids = torch.tensor(r["input_ids"])
        item = ds[i]
        assert item["input_ids"].tolist() == r["input_ids"] and item["loss_mask"].tolist() == r["loss_mask"]
        aux, last = _fake_forward(ids[None], torch.ones(1, len(ids), dtype=torch.long))
        assert item["aux_hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["aux_hidden_states"].float(), aux[0]) and torch.equal(item["last_hidden_state"].float(), last[0])
    batch = collate_offline([ds[0], ds[1]], pad_token_id=7)
    n0, n1 = len(rows[0]["input_ids"]), len(rows[1]["input_ids"])
    t = max(n0, n1)
    assert batch["aux_hidden_states"].shape == (2, t, 8) and batch["last_hidden_state"].shape == (2, t, H)
    short = 0 if n0 < n1 else 1
    assert batch["attention_mask"][short].sum() == min(n0, n1)
    assert not batch["aux_hidden_states"][short, min(n0, n1):].any()  # zero on padding


def test_resume_writes_only_missing_shards(tmp_path):
    rows = _rows()
    _write(tmp_path / "c", rows)
    files = sorted((tmp_path / "c").glob("train-*.safetensors"))
    before = {f.name: (f.stat().st_mtime_ns, load_file(f)) for f in files}
    files[1].unlink()
    plans = []
    stats = _write(tmp_path / "c", rows, on_plan=plans.append)
    assert plans[0]["shards_todo"] == 1 and plans[0]["shards_done"] == len(files) - 1 + 1  # + the val shard
    after = {f.name: (f.stat().st_mtime_ns, load_file(f)) for f in sorted((tmp_path / "c").glob("train-*.safetensors"))}
    assert after.keys() == before.keys()
    for name in before:
        assert after[name][1].keys() == before[name][1].keys()
        assert all(torch.equal(after[name][1][k], before[name][1][k]) for k in before[name][1])  # same tensors
        if name != files[1].name:
            assert after[name][0] == before[name][0]  # untouched
    assert stats["tokens_written"] == json.loads((tmp_path / "c" / "index.json").read_text())["splits"]["train"]["shards"][1]["num_tokens"]
    assert not list((tmp_path / "c").glob(".*"))  # no temporary left behind (jsonio.atomic_path: .<name>.XXXX)


def test_disk_short_is_an_error_before_writing(tmp_path, monkeypatch):
    import draftkit.generation.hidden_states as offline

    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(offline.shutil, "disk_usage", lambda p: real._replace(free=100))
    with pytest.raises(OSError, match=r"not enough disk .* bytes/token x \d+ tokens"):
        _write(tmp_path / "c", _rows())
    assert not (tmp_path / "c").exists()


def test_writer_refuses_a_cache_of_another_configuration(tmp_path):
    _write(tmp_path / "c", _rows())
    with pytest.raises(ValueError, match=r"another configuration \(differs in \['aux_layer_ids'\]\)"):
        write_hidden_states(tmp_path / "c", {"train": _rows()}, {**FP, "aux_layer_ids": [1, 3]}, _fake_forward, H, 2)


def test_truncated_missing_and_incomplete_shards_are_named(tmp_path):
    _write(tmp_path / "c", _rows())
    shard = tmp_path / "c" / "train-00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 40])
    with pytest.raises(ValueError, match=r"train-00001\.safetensors is truncated or corrupt"):
        HiddenStateCache(tmp_path / "c").dataset("train")
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=r"train-00001\.safetensors is missing"):
        HiddenStateCache(tmp_path / "c").verify("train")
    index = json.loads((tmp_path / "c" / "index.json").read_text())
    (tmp_path / "c" / "index.json").write_text(json.dumps({**index, "complete": False}))
    with pytest.raises(ValueError, match="is incomplete"):
        HiddenStateCache(tmp_path / "c")


# -- the tiny recipe end to end ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    """Hidden-state caches of the tiny recipe (fp32 target, the recipe's own, and a bf16 variant), built once.

    Module-scoped, so it sets the per-session draftkit cache itself (as the autouse fixture does per test).
    """
    from draftkit.commands.cache_hidden_states import cache_hidden_states

    root = tmp_path_factory.mktemp("hidden")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTKIT_CACHE", str(tmp_path_factory.getbasetemp() / "draftkit-cache"))
        mp.chdir(REPO)
        resolve_artifact("tiny:llama")  # building the target re-seeds the RNG: do it before any run
        out = {}
        for dtype in ("float32", "bfloat16"):
            r = cache_hidden_states([RECIPE], str(root / dtype), ["--model.target_dtype", dtype])
            assert r["bytes_per_token"] == 2 * 4 * 64 + 5 and r["tokens_written"] == r["tokens_total"]
            out[dtype] = root / dtype
    return out


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def _built(extra):
    cli = DraftkitCLI(args=["--recipe", RECIPE] + extra, run=False)
    cli.datamodule.setup("fit")
    cli.model.build(cli.datamodule)
    return cli.model, cli.datamodule


@pytest.mark.parametrize("dtype,rtol", [("bfloat16", 1e-5), ("float32", 2e-2)])
def test_offline_training_equals_online(tiny_cache, dtype, rtol):
    """Same batches, same initial head, 3 AdamW steps. With a bf16 target the cache is lossless: losses equal
    to rel 1e-5, total weight update to 1e-4 relative. With an fp32 target the bf16 storage of the states
    perturbs losses and first gradients by < 2 % and the total weight update by < 5 % (relative L2)."""
    online, dm_on = _built(["--model.target_dtype", dtype])
    offline, dm_off = _built(["--model.target_dtype", dtype, "--data.hidden_states_cache", str(tiny_cache[dtype])])
    assert isinstance(offline.target, TargetLMHead) and not offline.target_handle.loaded
    offline.head.load_state_dict(online.head.state_dict())
    models = (online, offline)
    params = [[p for p in m.head.parameters() if p.requires_grad] for m in models]
    opts = [torch.optim.AdamW(p, lr=1e-3) for p in params]
    initial = [p.detach().clone() for p in params[0]]
    losses = ([], [])
    for step, (b_on, b_off) in enumerate(zip(dm_on.train_dataloader(), dm_off.train_dataloader())):
        if step == 3:
            break
        assert torch.equal(b_on["input_ids"], b_off["input_ids"]) and torch.equal(b_on["loss_mask"], b_off["loss_mask"])
        grads = []
        for i, (m, b) in enumerate(zip(models, (b_on, b_off))):
            loss, stats = m.ttt_loss(b)
            grads.append(torch.autograd.grad(loss, params[i]))
            losses[i].append(float(loss))
            if i == 0:
                supervised = [float(s[2]) for s in stats]
            else:
                # the same supervised rows; with an fp32 target a near-tie argmax of the bf16-stored state may
                # move one position in or out of the draft vocab (within rtol of the count)
                got = [float(s[2]) for s in stats]
                assert len(got) == len(supervised) == 3 and all(w > 0 for w in supervised)  # the 3 TTT steps
                assert all(abs(a - b) <= rtol * b for a, b in zip(got, supervised))
            for p, g in zip(params[i], grads[-1]):
                p.grad = g
            opts[i].step()
        if step == 0:
            for a, b in zip(grads[1], grads[0]):
                assert float((a - b).norm()) <= rtol * float(b.norm()) + 1e-7
    assert losses[1] == pytest.approx(losses[0], rel=rtol)
    # Adam normalises each update, so compare the whole update, not single near-zero-gradient elements
    upd_on = torch.cat([(p - p0).flatten() for p, p0 in zip(params[0], initial)])
    upd_off = torch.cat([(p - p0).flatten() for p, p0 in zip(params[1], initial)])
    rel = float((upd_off - upd_on).norm() / upd_on.norm())
    assert rel <= (1e-4 if dtype == "bfloat16" else 0.05)  # measured 8e-6 and 1.1e-2
    if dtype == "float32":
        assert losses[1] != losses[0]  # the bf16 storage does show


def test_cache_mismatch_is_named(tiny_cache, tmp_path):
    cache = str(shutil.copytree(tiny_cache["float32"], tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"aux_layer_ids: cache has \[2, 4, 5\], this run has \[1, 3, 6\]"):
        _built(["--data.hidden_states_cache", cache, "--model.aux_layer_ids", "[1, 3, 6]"])
    with pytest.raises(ValueError, match=r"target_dtype: cache has 'float32', this run has 'bfloat16'"):
        _built(["--data.hidden_states_cache", cache, "--model.target_dtype", "bfloat16"])
    index_path = Path(cache) / "index.json"
    index = json.loads(index_path.read_text())
    index["fingerprint"]["target_config"] = "0" * 16
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="target_config: cache has '0000000000000000'"):
        _built(["--data.hidden_states_cache", cache])
    index["fingerprint"]["tokenizer"] = "f" * 16
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="tokenizer: cache has 'ffffffffffffffff'"):
        _built(["--data.hidden_states_cache", cache])


def _override(root: Path, max_steps: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"trainer": {
        "default_root_dir": str(root), "max_steps": max_steps, "limit_val_batches": 0, "enable_progress_bar": False,
        "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root), "name": "csv"}},
        "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {
            "dirpath": str(root / "ckpt"), "monitor": None, "every_n_train_steps": 2, "save_top_k": -1, "save_last": True}}],
    }, "data": {"bucket_window": 16}}
    (root / "o.yaml").write_text(yaml.safe_dump(cfg))
    return root / "o.yaml"


def _losses(root: Path) -> dict[int, float]:
    rows = list(csv.DictReader(open(next((root / "csv").glob("version_*/metrics.csv")))))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def test_offline_fit_resumes_exactly(tiny_cache, tmp_path):
    """Offline training resumed from its step-2 checkpoint repeats the uninterrupted run's losses to 1e-6
    (the loader position, optimizer and schedule are restored; no target forward is involved)."""
    cache = ["--data.hidden_states_cache", str(tiny_cache["float32"])]
    full, res = tmp_path / "full", tmp_path / "res"
    DraftkitCLI(args=["fit", "--recipe", RECIPE, "--recipe", str(_override(full, 4))] + cache)
    step2 = next((full / "ckpt").glob("*step=2*.ckpt"))
    DraftkitCLI(args=["fit", "--recipe", RECIPE, "--recipe", str(_override(res, 4)), "--ckpt_path", str(step2)] + cache)
    a, b = _losses(full), _losses(res)
    assert sorted(a) == [0, 1, 2, 3] and sorted(b) == [2, 3]
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-6), step
    assert a[3] != a[0]


def test_bench_prints_online_and_offline_side_by_side(tiny_cache, capsys):
    from draftkit.commands import main

    assert main(["bench", "train", "--recipe", RECIPE, "--cache", str(tiny_cache["float32"]), "--steps", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "online" in line and "offline" in line)
    assert header.split() == ["online", "offline"]
    row = next(line for line in out.splitlines() if line.strip().startswith("training tokens/s"))
    online, offline = (float(x) for x in row.split()[-2:])
    assert online > 0 and offline > 0


def test_acceptance_monitor_decodes_in_offline_mode(tiny_cache, tmp_path):
    """The long recipe's AcceptanceLengthMonitor in an offline run: it loads the full target once (the module
    keeps only the LM head) and logs the tau a direct evaluation of the same head gives; the module's
    target stays the LM head. Before, the first validation failed: decoding ran the LM-head-only target."""
    import lightning.pytorch as pl
    from draftkit.callbacks.acceptance import AcceptanceLengthMonitor

    from draftkit.data.prompts import load_prompts
    from draftkit.decoding.harness import evaluate_head
    from draftkit.target.frozen import FrozenTarget

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["hello there", "abc abc abc"]) + "\n")
    model, dm = _built(["--data.hidden_states_cache", str(tiny_cache["float32"])])
    monitor = AcceptanceLengthMonitor(num_prompts=2, k=3, max_new_tokens=8, prompts=str(prompts))
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_steps=2, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[monitor], accelerator="cpu",
    )
    trainer.fit(model, datamodule=dm)
    assert isinstance(model.target, TargetLMHead)
    assert isinstance(monitor._offline_target, FrozenTarget) and [s for s, _ in monitor.history] == [2]
    hf_model, tokenizer = model.load_target_model()
    expected = evaluate_head(model.head, FrozenTarget(hf_model, model.target.aux_layer_ids), tokenizer,
                             load_prompts(str(prompts), 2), k=3, max_new_tokens=8, baseline=False,
                             prompt_lookup=False, warmup=False)
    assert monitor.last_report["tau"] == pytest.approx(expected["tau"])
    assert float(trainer.callback_metrics["val/accept_len"]) == pytest.approx(expected["tau"])


def test_fit_with_auto_cache_writes_it_once_and_trains_offline(tiny_cache, tmp_path):
    """``data.hidden_states_cache: auto``: fit writes the cache under <draftkit cache>/hidden-states/ with the
    same tensors `cache-hidden-states` writes, trains offline with the losses of a run given that directory,
    and a second fit reuses every shard (files untouched)."""
    from draftkit.artifacts import cache_dir

    a = DraftkitCLI(args=["fit", "--recipe", RECIPE, "--recipe", str(_override(tmp_path / "a", 2)),
                          "--data.hidden_states_cache", "auto"])
    assert isinstance(a.model.target, TargetLMHead)
    assert not a.model.target_handle.loaded  # the full target is released once the cache is written
    root = Path(a.datamodule.hparams.hidden_states_cache)
    assert root.parent == cache_dir() / "hidden-states"
    shards = sorted(root.glob("*.safetensors"))
    assert [p.name for p in shards] == sorted(p.name for p in tiny_cache["float32"].glob("*.safetensors"))
    for p in shards:
        mine, theirs = load_file(p), load_file(tiny_cache["float32"] / p.name)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    b = tmp_path / "b"
    DraftkitCLI(args=["fit", "--recipe", RECIPE, "--recipe", str(_override(b, 2)),
                      "--data.hidden_states_cache", str(tiny_cache["float32"])])
    assert _losses(tmp_path / "a") == pytest.approx(_losses(b), rel=1e-6)
    mtimes = [p.stat().st_mtime_ns for p in shards]
    c = DraftkitCLI(args=["fit", "--recipe", RECIPE, "--recipe", str(_override(tmp_path / "c", 2)),
                          "--data.hidden_states_cache", "auto"])
    assert Path(c.datamodule.hparams.hidden_states_cache) == root
    assert [p.stat().st_mtime_ns for p in shards] == mtimes


def test_auto_cache_outside_fit_is_named():
    with pytest.raises(ValueError, match="hidden_states_cache: auto is resolved by `fit`"):
        _built(["--data.hidden_states_cache", "auto"])


def test_bench_online_stays_online_for_a_recipe_that_trains_offline(tiny_cache):
    """`bench train` on a recipe with ``hidden_states_cache: auto`` (the long recipe): the online measurement
    runs the target (it used to stop at the datamodule's `auto` outside fit), the offline one reads --cache."""
    from draftkit.commands.bench import measure_train

    auto = ["--data.hidden_states_cache", "auto"]
    online = measure_train([RECIPE], steps=1, warmup=0, overrides=auto)
    offline = measure_train([RECIPE], steps=1, warmup=0, overrides=auto, hidden_states_cache=str(tiny_cache["float32"]))
    assert online["mode"] == "online" and online["target_forward_s"] > 0
    assert offline["mode"] == "offline" and offline["tokens_per_step"] == online["tokens_per_step"]


def test_plan_shards_never_writes_an_empty_shard_and_equals_a_plain_reference():
    """A first sequence longer than the budget gets its own shard, with no empty shard before it (issue 56); and
    small random cases against the rule written out: close the shard before a sequence that would overflow it,
    unless the shard is empty."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    assert plan_shards([30, 1], "val", 12) == [
        {"file": "val-00000.safetensors", "rows": [0, 1], "num_tokens": 30},
        {"file": "val-00001.safetensors", "rows": [1, 2], "num_tokens": 1},
    ]
    assert plan_shards([], "train", 12) == []

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.lists(st.integers(1, 9), max_size=10), st.integers(1, 12))
    def check(lengths, budget):
        groups: list[list[int]] = []
        for i, n in enumerate(lengths):
            if groups and sum(lengths[j] for j in groups[-1]) + n <= budget:
                groups[-1].append(i)
            else:
                groups.append([i])
        want = [{"file": f"train-{g:05d}.safetensors", "rows": [rows[0], rows[-1] + 1],
                 "num_tokens": sum(lengths[j] for j in rows)} for g, rows in enumerate(groups)]
        assert plan_shards(lengths, "train", budget) == want

    check()


def test_non_finite_states_in_padding_are_not_stored_and_in_a_row_stop_the_shard(tmp_path):
    """Finiteness is checked once a batch on the target's device, over each row's real tokens only: NaN in the
    padding (a fully masked attention row can give it) writes the cache as without it; NaN in a row's real token
    stops naming that row and the counts, and writes nothing."""
    rows = _rows()

    def nan_in_padding(ids, attn):
        aux, last = _fake_forward(ids, attn)
        return aux.masked_fill(attn[..., None] == 0, float("nan")), last.masked_fill(attn[..., None] == 0, float("inf"))

    _write(tmp_path / "a", rows)
    write_hidden_states(
        tmp_path / "b", {"train": rows, "val": rows[:2]}, FP, nan_in_padding, H, 2, batch_size=3, shard_tokens=20)
    for split in ("train", "val"):
        a, b = HiddenStateCache(tmp_path / "a").dataset(split), HiddenStateCache(tmp_path / "b").dataset(split)
        for i in range(len(a)):
            assert torch.equal(a[i]["aux_hidden_states"], b[i]["aux_hidden_states"])
            assert torch.equal(a[i]["last_hidden_state"], b[i]["last_hidden_state"])

    bad = rows[4]["input_ids"][0]

    def nan_at_token(ids, attn):
        aux, last = _fake_forward(ids, attn)
        hit = (ids == bad) & (attn == 1)
        return aux.masked_fill(hit[..., None], float("nan")), last

    with pytest.raises(ValueError, match=r"hidden states of train row \d+ .*non-finite .*after the bf16 cast: [1-9]\d* "
                       r"aux, 0 last\); nothing of train-\d+\.safetensors was written"):
        write_hidden_states(tmp_path / "c", {"train": rows, "val": rows[:2]}, FP, nan_at_token, H, 2, batch_size=3,
                            shard_tokens=20)
