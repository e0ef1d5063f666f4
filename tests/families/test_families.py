"""Target families end to end on tiny random targets built offline (draftkit.testing.TINY_FAMILIES): a short
fit through the tiny recipe, a greedy evaluate whose speculative output equals plain decoding token for token
(float32), and an export for every engine read back to the trained weights."""

import csv
import math
from pathlib import Path

import pytest
import torch
import yaml

from draftkit.testing import TINY_FAMILIES, build_tiny_target

REPO = Path(__file__).resolve().parents[2]
FAMILIES = [f for f in TINY_FAMILIES if f not in ("llama", "gemma4_text")]  # tiny:llama has its own tests
PROMPTS = ["hello there", "write one line about the sea", "what is two plus two?"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: build_tiny_target(root / f, family=f) for f in FAMILIES}


def test_families_are_supported_by_the_head():
    from draftkit.heads.eagle3_llama import SUPPORTED_MODEL_TYPES
    from draftkit.testing import tiny_family_config

    assert {tiny_family_config(f).model_type for f in FAMILIES} <= set(SUPPORTED_MODEL_TYPES)


def test_gemma4_is_refused_naming_the_family_and_what_is_missing():
    from draftkit.heads.eagle3_llama import Eagle3Config
    from draftkit.testing import tiny_family_config

    with pytest.raises(ValueError, match=r"model_type 'gemma4_text' \(Gemma 4's attention differs per layer type"):
        Eagle3Config.from_target_config(tiny_family_config("gemma4_text"), [2, 4, 5], 64)


@pytest.mark.parametrize("family", FAMILIES)
def test_session_cache_equals_uncached_forward(family, family_dirs):
    """Plain greedy decoding over the session's cache (sliding-window layers kept whole, rolled back by crop)
    gives the tokens of a full forward per step."""
    from draftkit.decoding.verify import generate_plain, generate_uncached
    from draftkit.sampling import DecodeConfig
    from draftkit.target.frozen import FrozenTarget, load_target
    from draftkit.target.session import TargetSession

    model, tok = load_target(str(family_dirs[family]), "float32")
    target = FrozenTarget(model)
    ids = torch.tensor(tok("the sliding window is eight tokens wide")["input_ids"])  # longer than the window
    cfg = DecodeConfig(max_new_tokens=20)
    session = TargetSession(target)
    plain = generate_plain(session, ids, cfg).tokens
    session.crop(len(ids) + 3)  # a rollback past the window, as a rejected draft does
    assert plain == generate_uncached(target, ids, cfg, None)
    assert len(plain) == 20


@pytest.mark.parametrize("family", FAMILIES)
def test_fit_evaluate_export(family, family_dirs, tmp_path, monkeypatch):
    from draftkit.cli import DraftkitCLI
    from draftkit.decoding.harness import evaluate_head
    from draftkit.decoding.tree import TreeConfig
    from draftkit.export import ENGINES
    from draftkit.export.exporter import export_checkpoint
    from draftkit.export.load import load_exported_head, load_head
    from draftkit.target.frozen import FrozenTarget, load_target
    from draftkit.kernels import linears as kernels
    from draftkit.kernels.decode_attention import DECODE_ATTENTION
    from draftkit.kernels.option import use_kernels

    monkeypatch.chdir(REPO)
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump({
        "model": {"target": str(family_dirs[family]), "draft_vocab_size": 256},  # < V: d2t/t2d exported
        "trainer": {
            "default_root_dir": str(tmp_path), "max_steps": 4, "val_check_interval": 4, "limit_val_batches": 1,
            "enable_progress_bar": False, "log_every_n_steps": 1,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp_path), "name": "csv"}},
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True}}],
        },
    }))
    cli = DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(override)])
    assert cli.trainer.global_step == 4
    rows = list(csv.DictReader(open(next((tmp_path / "csv").glob("version_*/metrics.csv")))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] != losses[0], losses
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    head, meta = load_head(ckpt)
    assert all(torch.isfinite(p).all() for p in head.parameters())
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["draftkit"]["head_config"]["aux_layer_ids"] == [2, 4, 5]

    model, tok = load_target(str(family_dirs[family]), "float32")
    target = FrozenTarget(model, meta["aux_layer_ids"])
    report = evaluate_head(head, target, tok, PROMPTS, k=3, max_new_tokens=24, prompt_lookup=False,
                           collect_kl=False, warmup=False)
    assert report["greedy_equal"] == len(PROMPTS), report["greedy_equal"]
    # a tree's 4-D mask replaces the model's: sliding-window layers must get the window on top of it
    report = evaluate_head(head, target, tok, PROMPTS, tree=TreeConfig(3, 2, 6), max_new_tokens=24,
                           prompt_lookup=False, collect_kl=False, warmup=False)
    assert report["greedy_equal"] == len(PROMPTS), report["greedy_equal"]
    # the decoding kernels as `evaluate` sets them (packed and fused linears, the decode attention where the family
    # runs sdpa): the same acceptance, prompt by prompt
    own = model.config._attn_implementation  # eager for gemma2 (soft-capping) and gpt_oss (sinks)
    monkeypatch.setattr(kernels, "PACK_MIN_ELEMENTS", 0)  # pack even the tiny weights: fused q/k/v, gate/up
    with use_kernels("onednn" if kernels._onednn_available() else "auto", target, head) as applied:
        packed = applied.target
        assert model.config._attn_implementation == (DECODE_ATTENTION if own == "sdpa" else own)
        # per layer: q/k/v and gate/up; MoE experts are no nn.Linear; DeepSeek's MLA has no q/k/v siblings
        assert packed.fused_groups == {"qwen3_moe": 8, "gpt_oss": 8, "deepseek_v3": 8}.get(family, 16)
        fast = evaluate_head(head, target, tok, PROMPTS, tree=TreeConfig(3, 2, 6), max_new_tokens=24,
                             prompt_lookup=False, collect_kl=False, warmup=False)
    assert fast["greedy_equal"] == len(PROMPTS), fast["greedy_equal"]
    assert [(r["rounds"], r["new_tokens"]) for r in fast["per_prompt"]] == [
        (r["rounds"], r["new_tokens"]) for r in report["per_prompt"]]

    state = head.export_state_dict()
    for engine in (e for e in ENGINES if e != "llamacpp"):  # needs the target's GGUF: test_llamacpp_export.py
        out = export_checkpoint(ckpt, engine, tmp_path / engine, dtype="float32")
        back, _ = load_exported_head(out)
        for name, value in back.export_state_dict().items():
            torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=f"{engine}: {name}")
