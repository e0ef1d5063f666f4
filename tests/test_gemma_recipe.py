"""recipes/gemma3-270m-eagle3.yaml on a tiny random gemma3_text target built offline: its plain-text template
(a base model has no chat template) tokenizes as draftkit's ``plain`` prompts do, and the recipe, target and data
swapped for tiny ones, trains a few steps and decodes greedy-equal with the template its checkpoint carries."""

import csv
import math
from pathlib import Path

import pytest
import torch
import yaml

from draftkit.testing import build_tiny_target

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "gemma3-270m-eagle3.yaml"
TEMPLATE = yaml.safe_load(RECIPE.read_text())["data"]["chat_template"]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("gemma") / "gemma3_text", family="gemma3_text")


@pytest.fixture(scope="module")
def tok(gemma_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma_dir)


def test_recipe_targets_gemma_and_reads_plain_text():
    recipe = yaml.safe_load(RECIPE.read_text())
    assert recipe["model"]["target"] == "chunks:gemma-3-270m-q4_k_m.gguf"
    assert recipe["data"]["supervise"] == "all" and recipe["model"]["draft_vocab_size"] == 16384


def test_plain_template_is_bos_then_turns_joined_by_a_blank_line(tok):
    from draftkit.data.chat import tokenize_conversation

    messages = [{"role": "user", "content": "ab?"}, {"role": "assistant", "content": "cd."},
                {"role": "user", "content": "e"}, {"role": "assistant", "content": "fg"}]
    assert tok.apply_chat_template(messages, tokenize=False, chat_template=TEMPLATE) == "<|im_start|>ab?\n\ncd.\n\ne\n\nfg"
    out = tokenize_conversation(tok, messages, TEMPLATE)
    # byte-level tokenizer: one token per character after the BOS
    assert out["input_ids"] == [tok.bos_token_id] + tok("ab?\n\ncd.\n\ne\n\nfg", add_special_tokens=False)["input_ids"]
    # the answers' tokens carry the mask, each with the blank line before it (the template has no generation prompt)
    assert out["loss_mask"] == [0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1]


def test_an_evaluate_prompt_is_bos_and_its_text_as_the_plain_rule(tok):
    """``evaluate`` renders a prompt with the checkpoint's template: <bos> + the user text, no generation prompt,
    the ids ``encode_prompt(..., "plain")`` gives where the tokenizer adds its BOS to plain text (Gemma's does)."""
    from draftkit.data.prompts import Prompt, encode_prompt

    prompt = Prompt("1", [{"role": "user", "content": "hello there"}])
    assert encode_prompt(prompt, tok, "chat", TEMPLATE) == [tok.bos_token_id] + tok("hello there", add_special_tokens=False)["input_ids"]


def test_recipe_trains_on_a_tiny_gemma3_text_and_decodes_greedy_equal(gemma_dir, tok, tmp_path, monkeypatch):
    from draftkit.cli import DraftkitCLI
    from draftkit.decoding.harness import evaluate_head
    from draftkit.export.load import load_head
    from draftkit.target.frozen import FrozenTarget, load_target

    monkeypatch.chdir(REPO)
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump({
        "model": {"target": str(gemma_dir), "target_dtype": "float32", "draft_vocab_size": 64},
        "data": {"path": "recipes/data/tiny-chat.jsonl", "max_conversations": None, "max_length": 128,
                 "val_size": 4, "num_proc": 1, "bucket_window": 0},
        "trainer": {
            "default_root_dir": str(tmp_path), "max_time": None, "max_steps": 3, "val_check_interval": 3,
            "limit_val_batches": 1, "precision": "32-true", "enable_progress_bar": False, "log_every_n_steps": 1,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp_path), "name": "csv"}},
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True}}],
        },
    }))
    cli = DraftkitCLI(args=["fit", "--recipe", str(RECIPE), "--recipe", str(override)])
    assert cli.trainer.global_step == 3
    assert cli.model.head.config.aux_layer_ids == [2, 4, 5]  # the default rule on 8 layers
    rows = list(csv.DictReader(open(next((tmp_path / "csv").glob("version_*/metrics.csv")))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["draftkit"]["chat_template"] == TEMPLATE  # evaluate renders prompts with it

    head, meta = load_head(ckpt)
    model, _ = load_target(str(gemma_dir), "float32")
    target = FrozenTarget(model, meta["aux_layer_ids"])
    prompts = ["hello there", "write one line about the sea"]
    report = evaluate_head(head, target, tok, prompts, k=3, max_new_tokens=16, chat_template=meta["chat_template"],
                           prompt_lookup=False, collect_kl=False, warmup=False)
    assert report["greedy_equal"] == len(prompts), report["greedy_equal"]
