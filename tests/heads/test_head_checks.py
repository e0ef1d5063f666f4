"""One set of checks for a head and its target (issue 14, item 3): finite weights and draft logits, and the
tokenizer the head was trained with, in evaluate, export and export directories."""

import dataclasses
import json
import shutil

import pytest
import torch

from draftkit.export.exporter import export_checkpoint
from draftkit.export.load import load_head
from draftkit.heads.eagle3_llama import Eagle3Config, Eagle3LlamaHead
from draftkit.selection.vocab import VocabMap
from draftkit.target.tokens import tokenizer_identity


def _head(target_dir) -> Eagle3LlamaHead:
    from transformers import AutoConfig

    cfg = Eagle3Config.from_target_config(AutoConfig.from_pretrained(target_dir), [2, 4, 5], 320)
    torch.manual_seed(0)
    head = Eagle3LlamaHead(cfg)
    vocab = VocabMap.from_ids(torch.arange(320), 320)
    head.set_vocab(vocab.d2t, vocab.t2d)
    return head.eval()


def _ckpt(path, target_dir, head=None, chat_template=None):
    """A training checkpoint as ``draftkit fit`` writes it, with the training tokenizer's fingerprint."""
    from transformers import AutoTokenizer

    head = head or _head(target_dir)
    meta = {
        "head_config": dataclasses.asdict(head.config), "target": str(target_dir), "target_dtype": "float32",
        "chat_template": chat_template, "ttt": {"steps": 3, "decay": 0.8},
        "tokenizer_fingerprint": tokenizer_identity(AutoTokenizer.from_pretrained(target_dir), chat_template),
    }
    torch.save({"state_dict": {f"head.{k}": v for k, v in head.export_state_dict().items()}, "draftkit": meta}, path)
    return path


def _permuted_copy(src, dest):
    """User case b15 (permuted tokenizer): the same tokenizer size, the 256 byte tokens' ids reversed."""
    shutil.copytree(src, dest)
    p = dest / "tokenizer.json"
    t = json.loads(p.read_text())
    items = sorted(t["model"]["vocab"].items(), key=lambda kv: kv[1])
    ids = [i for _, i in items]
    t["model"]["vocab"] = {tok: ids[len(ids) - 1 - n] for n, (tok, _) in enumerate(items)}
    p.write_text(json.dumps(t))
    return dest


def test_case_nan_head_is_refused_by_evaluate_and_export(tmp_path, tiny_target_dir):
    """User case b14 (NaN head): one NaN weight evaluated as tau 1.000, KL nan, exit 0."""
    from draftkit.commands.evaluate import evaluate

    head = _head(tiny_target_dir)
    with torch.no_grad():
        head.fc.weight[0, 0] = float("nan")
    ckpt = _ckpt(tmp_path / "nan.ckpt", tiny_target_dir, head)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "p1", "prompt": "Name three primary colors."}\n')
    message = r"checkpoint .*nan.ckpt: fc.weight has non-finite values \(NaN/inf\); the head would draft garbage"
    with pytest.raises(ValueError, match=message):
        evaluate(checkpoint=str(ckpt), prompts=str(prompts), output=str(tmp_path / "r.json"), max_new_tokens=4)
    with pytest.raises(ValueError, match=message):
        export_checkpoint(ckpt, "vllm", tmp_path / "out")
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "out").exists()


def test_non_finite_draft_logits_are_refused(tiny_target_dir):
    """Another fault of the kind: finite weights whose logits overflow (lm_head rows of 1e38)."""
    from transformers import AutoTokenizer

    from draftkit.decoding.harness import evaluate_head
    from draftkit.target.frozen import FrozenTarget, load_target

    model, tokenizer = load_target(str(tiny_target_dir), "float32")
    target = FrozenTarget(model, [2, 4, 5])
    head = _head(tiny_target_dir)
    head.load_embedding(target.input_embeddings().float())
    with torch.no_grad():
        head.lm_head.weight.fill_(1e38)
    with pytest.raises(ValueError, match=r"prompt 0 .*non-finite draft logits at draft position 1: 320 of 320 values \(float32\)"):
        evaluate_head(head, target, AutoTokenizer.from_pretrained(tiny_target_dir), ["hi"], k=2, max_new_tokens=4,
                      baseline=False, prompt_lookup=False, warmup=False)


def test_case_permuted_tokenizer_is_refused_by_export_and_evaluate(tmp_path, tiny_target_dir):
    """User case b15 (permuted tokenizer): a target whose tokenizer has the same size but permuted ids was
    accepted by both. A training checkpoint and an export directory both record the fingerprint."""
    from transformers import AutoTokenizer

    perm = _permuted_copy(tiny_target_dir, tmp_path / "tiny-perm")
    ckpt = _ckpt(tmp_path / "head.ckpt", tiny_target_dir)
    trained = tokenizer_identity(AutoTokenizer.from_pretrained(tiny_target_dir))
    other = tokenizer_identity(AutoTokenizer.from_pretrained(perm))
    assert trained != other
    message = (rf"was trained with tokenizer fingerprint {trained}, but the target's tokenizer \(.*tiny-perm\) has "
               rf"{other}: another vocabulary, special tokens or chat template")
    with pytest.raises(ValueError, match=message):
        export_checkpoint(ckpt, "vllm", tmp_path / "out-perm", target=str(perm))
    with pytest.raises(ValueError, match=message):
        load_head(ckpt, str(perm))  # what evaluate loads with --target
    exported = export_checkpoint(ckpt, "vllm", tmp_path / "out", dtype="float32")
    head, meta = load_head(exported)  # the export's own target: accepted
    assert meta["export"]["tokenizer_fingerprint"] == trained
    with pytest.raises(ValueError, match=message):
        load_head(exported, str(perm))


def test_another_chat_template_is_a_mismatch_unless_the_head_names_its_own(tmp_path, tiny_target_dir):
    """Another mismatch: the same vocabulary with another chat template. A head trained with an explicit
    data.chat_template carries it, so the target's own template does not matter for it."""
    other = tmp_path / "tiny-template"
    shutil.copytree(tiny_target_dir, other)
    (other / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    with pytest.raises(ValueError, match="was trained with tokenizer fingerprint"):
        load_head(_ckpt(tmp_path / "a.ckpt", tiny_target_dir), str(other))
    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    head, meta = load_head(_ckpt(tmp_path / "b.ckpt", tiny_target_dir, chat_template=own), str(other))
    assert meta["chat_template"] == own
