"""Eagle3Module: TTT alignment, loss against a plain reference (value and gradient), empty batches."""

import math

import pytest
import torch
import torch.nn.functional as F

from draftkit.data.datamodule import ChatDataModule
from draftkit.models.eagle3 import Eagle3Module, OptimConfig
from draftkit.models.ttt import soft_ce, tau_sim, ttt_targets


def test_ttt_alignment_worked_example():
    """eagle3-format.md §4.1: [S, U1, U2, H, A1, A2, EOT], m = [0,0,0,0,1,1,1]."""
    ids = torch.arange(7)[None]
    m = torch.tensor([[0, 0, 0, 0, 1, 1, 1]], dtype=torch.float)
    in_draft = torch.ones(1, 7, dtype=torch.bool)
    rows = []
    for k in range(3):
        step_ids, w, offset = ttt_targets(ids, m, in_draft, k)
        rows.append(w[0].nonzero().squeeze(-1).tolist())
        assert offset == 1 + k
        assert step_ids[0, : 6 - k].tolist() == list(range(1 + k, 7))
    assert rows == [[2, 3, 4], [1, 2, 3], [0, 1, 2]]
    # a row whose teacher's top token is outside the draft vocab is not supervised
    in_draft[0, 4] = False  # z_4 predicts x_5 = A2: row 3 at step 0
    _, w, _ = ttt_targets(ids, m, in_draft, 0)
    assert w[0].nonzero().squeeze(-1).tolist() == [2, 4]


def test_tau_sim():
    assert tau_sim([1.0, 1.0, 1.0]) == 4.0
    assert tau_sim([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert tau_sim([0.0, 1.0]) == 1.0


@pytest.fixture()
def built_module(tiny_target_dir, tiny_chat_jsonl):
    torch.manual_seed(0)
    dm = ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(tiny_target_dir), max_length=64, val_size=2, batch_size=3)
    dm.setup("fit")
    model = Eagle3Module(str(tiny_target_dir), target_dtype="float32", draft_vocab_size=200, ttt={"steps": 3, "decay": 0.8})
    model.build(dm)
    for p in model.head.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.3)
    return model, dm


def _reference_loss(model, batch):
    """Plain loops over steps and rows, straight from eagle3-format.md §4.1/§4.3."""
    head, steps, decay = model.head, model.ttt.steps, model.ttt.decay
    ids, attn, m = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    out = model.target(ids, attention_mask=attn)
    z = out.logits
    b, t = ids.shape
    lengths = attn.sum(1).tolist()
    feature = head.project(out.aux_hidden_states)
    cache, total = [], 0.0
    pos = torch.arange(t).expand(b, t)
    for k in range(steps):
        step_ids = torch.zeros_like(ids)
        step_ids[:, : t - 1 - k] = ids[:, 1 + k :]
        logits, feature = head.ttt_step(step_ids, feature, pos + k, cache, attn.bool())
        loss, count = torch.zeros((), dtype=torch.float64), 0
        for i in range(b):
            for p in range(t):
                if p + 2 + k >= lengths[i] or not m[i, p + 2 + k] or not head.t2d[z[i, p + 1 + k].argmax()]:
                    continue
                prob = F.softmax(z[i, p + 1 + k][head.t2d].double(), -1)
                logq = F.log_softmax(logits[i, p].double(), -1)
                loss = loss - (prob * logq).sum()
                count += 1
        total = total + decay**k * loss / max(1, count)
    return total


def test_loss_matches_reference_value_and_gradient(built_module):
    model, dm = built_module
    batch = next(iter(dm.train_dataloader()))
    params = [p for p in model.head.parameters() if p.requires_grad]
    loss, stats = model.ttt_loss(batch)
    grads = torch.autograd.grad(loss, params)
    ref = _reference_loss(model, batch)
    ref_grads = torch.autograd.grad(ref, params)
    assert float(stats[0][2]) > 0
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-4, atol=1e-6)


def test_all_masked_batch_is_finite_and_zero(built_module):
    model, dm = built_module
    batch = next(iter(dm.train_dataloader()))
    batch = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
    loss, stats = model.ttt_loss(batch)
    assert math.isfinite(float(loss)) and float(loss) == 0.0
    assert all(float(w) == 0 and float(n) == 0 for _, _, w, n in stats)


def test_soft_ce_hand_computed():
    """Three rows, known logits and teacher: loss, correct count and weight sum to the last digit."""
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    argmax = torch.tensor([0, 2, 2])  # rows 0 and 2 agree with the draft's argmax, row 1 does not
    weight = torch.tensor([1.0, 1.0, 0.5])
    loss_sum, correct_sum, weight_sum = soft_ce(logits, probs, argmax, weight)
    ce = [math.log(math.e**2 + 2) - 1.0, math.log(math.e + 2), math.log(math.e**3 + 2) - 3.0]
    assert float(loss_sum) == pytest.approx(ce[0] + ce[1] + 0.5 * ce[2], rel=1e-6)
    assert float(correct_sum) == 1.5 and float(weight_sum) == 2.5


class _IdentityLMHead(torch.nn.Module):
    """Offline-mode stand-in for the target's LM head: the batch's ``last_hidden_state`` *are* the logits."""

    def logits(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        return last_hidden_state


@pytest.fixture()
def full_vocab_module(tiny_target_dir):
    """A built module on the tiny target with V_d = V (identity vocab, no datamodule needed), K = 1."""
    torch.manual_seed(0)
    model = Eagle3Module(str(tiny_target_dir), target_dtype="float32", draft_vocab_size=320, ttt={"steps": 1})
    model.build()
    for p in model.head.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.3)
    return model


def _offline_batch(model, teacher_logits: torch.Tensor, loss_mask: torch.Tensor, seed: int = 0) -> dict:
    """A batch in the offline layout whose teacher logits are given: (B, T, V) -> batch dict."""
    g = torch.Generator().manual_seed(seed)
    b, t, _ = teacher_logits.shape
    width = model.head.fc.weight.shape[1]
    return {
        "input_ids": torch.randint(0, 256, (b, t), generator=g),
        "attention_mask": torch.ones(b, t, dtype=torch.long),
        "loss_mask": loss_mask,
        "aux_hidden_states": torch.randn(b, t, width, generator=g),
        "last_hidden_state": teacher_logits,
    }


def test_accuracy_and_tau_sim_on_a_hand_built_teacher(full_vocab_module):
    """Teacher argmax at position p+1 is set to the draft's argmax at row p on 3 of the 5 supervised rows:
    acc_0 = 3/5 and tau_sim = 1.6 exactly (a draft compared with the teacher one row early, or counting
    mismatches, gives other numbers)."""
    model = full_vocab_module
    model.target = _IdentityLMHead()
    t, v = 8, 320
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])  # step 0 supervises rows p = 1..5 (m_{p+2} = 1)
    batch = _offline_batch(model, torch.zeros(1, t, v), loss_mask)
    with torch.no_grad():  # the draft's own argmax per row, from a plain step-0 pass
        ids = torch.cat([batch["input_ids"][:, 1:], torch.zeros(1, 1, dtype=torch.long)], 1)
        logits, _ = model.head.ttt_step(ids, model.head.project(batch["aux_hidden_states"]), torch.arange(t)[None],
                                        [], torch.ones(1, t, dtype=torch.bool))
    draft = logits[0].argmax(-1).tolist()  # (T,)
    teacher = torch.zeros(1, t, v)
    for q in range(t):
        teacher[0, q, (7 * q + 3) % v] = 5.0  # rows outside the supervised range: arbitrary confident tokens
    for p in (1, 3, 4):
        teacher[0, p + 1] = 0.0
        teacher[0, p + 1, draft[p]] = 5.0  # agree
    for p in (2, 5):
        teacher[0, p + 1] = 0.0
        teacher[0, p + 1, (draft[p] + 1) % v] = 5.0  # disagree
    batch["last_hidden_state"] = teacher
    _, stats = model.ttt_loss(batch)
    (_, correct, weight, scored), = stats
    assert (float(correct), float(weight)) == (3.0, 5.0)
    assert float(scored) == 5.0  # full draft vocab: every scored row is supervised
    assert tau_sim([float(c / n) for _, c, _, n in stats]) == pytest.approx(1.6)  # what train/tau_sim logs


def test_entropy_filter_keys_each_token_on_the_previous_teacher_position(tiny_target_dir):
    """Inside the module, token t is kept iff H(z_{t-1}) >= threshold: with uniform (high-entropy) teacher
    rows at positions 2 and 5 only, the supervised tokens are 3 and 6, so step-0 rows 1 and 4."""
    t, v = 8, 320
    teacher = torch.zeros(1, t, v)
    for q in range(t):
        if q not in (2, 5):
            teacher[0, q, q] = 30.0  # peaked: entropy ~ 0 nats; uniform rows have log 320 = 5.77 nats
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    for mode, kept in (("drop", 0.0), ("downweight", 0.1)):
        torch.manual_seed(0)
        model = Eagle3Module(str(tiny_target_dir), target_dtype="float32", draft_vocab_size=320, ttt={"steps": 2},
                             entropy_filter={"mode": mode, "threshold": 1.0, "downweight": 0.1})
        model.build()
        expected = torch.tensor([[0, 0, 0, 1, kept, kept, 1, kept]])
        torch.testing.assert_close(model._loss_weights(loss_mask, teacher), expected)
        model.target = _IdentityLMHead()
        _, stats = model.ttt_loss(_offline_batch(model, teacher, loss_mask))
        # step 0: row p weighs token p+2 (rows 1..5); step 1: token p+3 (rows 0..4)
        assert [float(w) for _, _, w, _ in stats] == pytest.approx([2 + 3 * kept, 2 + 3 * kept])


def test_lr_schedule_is_linear_warmup_then_cosine(full_vocab_module):
    """lr(s) = lr (s+1)/W for s < W, then lr (r + (1-r) (1 + cos(pi (s-W)/(S-W)))/2), S = 110, W = 10."""
    from types import SimpleNamespace

    model = full_vocab_module
    model.optim = OptimConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    model._trainer = SimpleNamespace(estimated_stepping_batches=110)
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    lrs = {}
    for step in range(121):
        lrs[step] = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
    expected = {0: 1e-4, 4: 5e-4, 9: 1e-3, 10: 1e-3, 35: 1e-4 + 9e-4 * (1 + math.sqrt(0.5)) / 2, 60: 5.5e-4,
                85: 1e-4 + 9e-4 * (1 - math.sqrt(0.5)) / 2, 110: 1e-4, 120: 1e-4}
    assert {s: lrs[s] for s in expected} == pytest.approx(expected, rel=1e-9)


def test_init_from_target_copies_the_draft_vocab_rows(tiny_target_dir, tiny_chat_jsonl):
    """model.init_from_target=True: lm_head row i is the target's row i + d2t[i] (V_d = 200 < V = 320)."""
    dm = ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(tiny_target_dir), max_length=64, val_size=2)
    heads = {}
    for init in (True, False):
        model = Eagle3Module(str(tiny_target_dir), target_dtype="float32", draft_vocab_size=200, init_from_target=init)
        model.build(dm)
        heads[init] = model.head
    head, target = heads[True], model.target
    ids = torch.arange(200) + head.d2t  # (V_d,) target id of each draft id
    assert int(ids[-1]) > 199  # a real offset: the draft vocab is not the first 200 ids
    assert torch.equal(head.lm_head.weight, target.lm_head_weight()[ids])
    assert torch.equal(head.norm.weight, target.final_norm_weight())
    assert not torch.equal(heads[False].lm_head.weight, target.lm_head_weight()[ids])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_freeze_lm_head_keeps_the_target_rows_through_training(tiny_target_dir, tiny_chat_jsonl, optimizer):
    """model.freeze_lm_head: after 3 optimizer steps lm_head is still the target's rows bit for bit, while fc and
    norm moved; the optimizer holds every trainable head parameter except lm_head."""
    import lightning.pytorch as pl

    torch.manual_seed(0)
    dm = ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(tiny_target_dir), max_length=64, val_size=2, batch_size=2)
    model = Eagle3Module(str(tiny_target_dir), target_dtype="float32", draft_vocab_size=200, ttt={"steps": 2},
                         init_from_target=True, freeze_lm_head=True,
                         optim={"optimizer": optimizer, "lr": 1e-2, "warmup_steps": 0})
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, max_steps=3, limit_val_batches=0)
    dm.setup("fit")
    model.build(dm)
    fc0, norm0 = model.head.fc.weight.detach().clone(), model.head.norm.weight.detach().clone()
    trainer.fit(model, dm)
    head = model.head
    rows = torch.arange(200) + head.d2t
    assert trainer.global_step == 3
    assert torch.equal(head.lm_head.weight, model.target.lm_head_weight()[rows])
    assert not torch.equal(head.fc.weight, fc0) and not torch.equal(head.norm.weight, norm0)
    optimized = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    expected = {id(p) for n, p in head.named_parameters() if p.requires_grad}
    assert optimized == expected and id(head.lm_head.weight) not in optimized
    assert len(expected) == sum(1 for n, _ in head.named_parameters() if n not in ("lm_head.weight", "embed_tokens.weight"))


def test_freeze_lm_head_without_init_from_target_is_refused(tiny_target_dir):
    with pytest.raises(ValueError, match=r"model.freeze_lm_head: true .* needs model.init_from_target: true"):
        Eagle3Module(str(tiny_target_dir), freeze_lm_head=True)


def test_target_lm_head_and_later_steps_run_only_where_the_loss_needs_them(built_module):
    """The target LM head sees only positions whose next token is supervised, and TTT step k >= 1 computes
    only rows that step k or a later one supervises (the loss itself is checked against the reference above)."""
    model, dm = built_module
    batch = next(iter(dm.train_dataloader()))
    seen = {"lm_head": [], "fc_rows": []}
    lm_head = model.target.model.get_output_embeddings()
    hooks = [
        lm_head.register_forward_hook(lambda m, i, o: seen["lm_head"].append(i[0].shape[0])),
        model.head.midlayer.mlp.register_forward_hook(lambda m, i, o: seen["fc_rows"].append(i[0].shape[:-1].numel())),
    ]
    try:
        model.ttt_loss(batch)
    finally:
        for h in hooks:
            h.remove()
    m = batch["loss_mask"] * batch["attention_mask"]
    assert seen["lm_head"] == [int(m[:, 1:].sum())] and seen["lm_head"][0] < m.numel()
    b, t = m.shape
    rows = seen["fc_rows"]
    assert rows[0] == b * t and len(rows) == model.ttt.steps
    assert all(rows[k] >= rows[k + 1] for k in range(1, len(rows) - 1)) and rows[1] < b * t
    # step k >= 1 computes row (i, p) iff some step k' >= k supervises it (plain loops, eagle3-format.md §4.1)
    z = model.target(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    steps = model.ttt.steps

    def supervised(i, p, k):
        return p + 2 + k < t and bool(m[i, p + 2 + k]) and bool(model.head.t2d[z[i, p + 1 + k].argmax()])

    for k in range(1, steps):
        expected = sum(any(supervised(i, p, kk) for kk in range(k, steps)) for i in range(b) for p in range(t))
        assert rows[k] == expected


# -- runs without signal (issue 14, item 2) --------------------------------------------------------------------


def _fit(model, dm, tmp_path, monitor="val/tau_sim", **trainer_kw):
    """Fit on CPU with a CSV logger and a "best" checkpoint on ``monitor``; return (trainer, logged rows)."""
    import csv

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="best-{step}", monitor=monitor, mode="max")
    trainer = pl.Trainer(accelerator="cpu", logger=CSVLogger(tmp_path, name="csv"), callbacks=[ckpt],
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         num_sanity_val_steps=0, **trainer_kw)
    try:
        trainer.fit(model, dm)
    finally:
        files = list((tmp_path / "csv").glob("version_*/metrics.csv"))
        rows = list(csv.DictReader(open(files[0]))) if files else []
        trainer.rows = rows
    return trainer, rows


def _empty_on(model, batches: set[int]):
    """Make the TTT loss of the given training batch indices (counted from 0 over the run) supervise nothing."""
    real, seen = model.ttt_loss, []

    def ttt_loss(batch, batch_idx=0):
        total, stats = real(batch, batch_idx)
        if model.training:
            seen.append(len(seen))
            if seen[-1] in batches:
                return total * 0, [tuple(x * 0 for x in s) for s in stats]
        return total, stats

    model.ttt_loss = ttt_loss


def test_case_entropy_filter_removing_every_position_stops_before_anything_is_written(tmp_path, monkeypatch):
    """User case b07: tiny-debug with entropy_filter {mode: drop, threshold: 1000} used to run 4 "steps" with
    no update, write best-step=4.ckpt and log NaN and 0.0 validation metrics."""
    import yaml

    from draftkit.cli import DraftkitCLI

    repo = __import__("pathlib").Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    run = tmp_path / "run"
    override = tmp_path / "b07.yaml"
    override.write_text(yaml.safe_dump({
        "model": {"entropy_filter": {"mode": "drop", "threshold": 1000.0}},
        "trainer": {"max_steps": 4, "default_root_dir": str(run), "logger": {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(run)}},
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"dirpath": str(run / "ckpt"), "monitor": "val/tau_sim", "mode": "max"}}]},
    }))
    with pytest.raises(ValueError, match=(
            r"^no trainable tokens: model.entropy_filter.threshold=1000.0 nats exceeds ln V = 5.768 nats, the largest "
            r"entropy a 320-token distribution can have, so mode=drop removes every position")):
        DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--recipe", str(override)])
    assert not run.exists()


def test_batches_without_trainable_tokens_are_not_optimizer_steps(built_module, tmp_path):
    """Another no-signal input: training batches 1 and 2 supervise nothing. They change no weight, do not
    advance the step count or the LR schedule, and log no NaN or placeholder."""
    model, dm = built_module
    _empty_on(model, {1, 2})
    heads = []

    class Watch(__import__("lightning.pytorch", fromlist=["Callback"]).Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            heads.append((trainer.global_step, pl_module.head.fc.weight.detach().clone(),
                          trainer.lr_scheduler_configs[0].scheduler.last_epoch))

    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=[Watch()],
                         enable_progress_bar=False, enable_model_summary=False, max_steps=2, limit_val_batches=0)
    trainer.fit(model, dm)
    assert [s for s, _, _ in heads] == [1, 1, 1, 2]  # batches 1, 2 are not steps; max_steps=2 needs 4 batches
    assert torch.equal(heads[0][1], heads[1][1]) and torch.equal(heads[1][1], heads[2][1])
    assert not torch.equal(heads[2][1], heads[3][1])
    assert [n for _, _, n in heads] == [1, 1, 1, 2]  # LR schedule steps
    assert model.empty_batches == 2


def test_validation_never_logs_nan_or_placeholders(built_module, tmp_path):
    """TTT steps without a supervised row in validation are left out, not logged as NaN or 0.0, and tau_sim is
    only logged when every step was measured."""
    _, dm = built_module
    model = Eagle3Module(dm.hparams.tokenizer, target_dtype="float32", draft_vocab_size=320,
                         ttt={"steps": 3, "decay": 0.8})  # full vocab: every validation row is supervised
    real = model.ttt_loss

    def ttt_loss(batch, batch_idx=0):  # validation: steps 1 and 2 never supervised
        total, stats = real(batch, batch_idx)
        if not model.training:
            stats = [stats[0]] + [tuple(x * 0 for x in s) for s in stats[1:]]
        return total, stats

    model.ttt_loss = ttt_loss
    model.hparams.serving_k = 2
    trainer, rows = _fit(model, dm, tmp_path, "val/loss", max_steps=2, val_check_interval=2, limit_val_batches=1)
    logged = {k for r in rows for k, v in r.items() if v not in ("", None)}
    assert {"val/acc_0", "val/loss_0", "val/loss"} <= logged
    assert not logged & {"val/acc_1", "val/loss_1", "val/acc_2", "val/tau_sim", "val/tau_sim_k2"}
    values = [float(v) for r in rows for k, v in r.items() if k.startswith(("val/", "train/")) and v]
    assert values and all(math.isfinite(v) for v in values)


def test_no_best_checkpoint_for_a_head_without_update(built_module, tmp_path):
    """Every training batch empty: validation refuses to score the untouched head and the run stops."""
    model, dm = built_module
    _empty_on(model, set(range(100)))
    with pytest.raises(RuntimeError, match=(
            r"no trainable tokens: every one of the 2 training batches before validation had no supervised "
            r"position after the assistant mask, the entropy filter \(model.entropy_filter: off\)")):
        _fit(model, dm, tmp_path, max_steps=4, val_check_interval=2, limit_val_batches=1)
    assert not (tmp_path / "ckpt").exists()


def test_an_epoch_without_trainable_tokens_stops_the_run(built_module, tmp_path):
    model, dm = built_module
    _empty_on(model, set(range(100)))
    with pytest.raises(RuntimeError, match=r"every one of the 2 training batches of epoch 0 had no supervised"):
        _fit(model, dm, tmp_path, max_steps=4, limit_val_batches=0)
    assert not (tmp_path / "ckpt").exists()


def test_lr_replan_is_continuous_and_ends_at_the_new_horizon():
    """set_lr_horizon: the first plan is the plain schedule; a re-plan at step r keeps LR(r) bit for bit and
    reaches lr * min_lr_ratio exactly at the new H (down or up); one during the warmup keeps the warmup;
    lr_anchor survives the checkpoint meta, and a checkpoint without it loads as the first plan."""
    model = Eagle3Module("unused", optim=OptimConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1))
    model.set_lr_horizon(110, 12)
    assert model.lr_anchor is None
    plain = [model.lr_factor(s) for s in range(121)]
    assert plain[110] == 0.1 and plain[60] == pytest.approx(0.55, rel=1e-12)
    for r, horizon in [(40, 80), (60, 150), (149, 152)]:  # down, up, one step before the end
        before = model.lr_factor(r)
        model.set_lr_horizon(horizon, r)
        assert model.lr_anchor[:2] == (10, r) and model.lr_factor(r) == before
        assert model.lr_factor(horizon) == model.lr_factor(horizon + 5) == 0.1
        assert all(model.lr_factor(s) == plain[s] for s in range(10))  # the warmup is kept
        lrs = [model.lr_factor(s) for s in range(r, horizon + 1)]
        assert all(b < a for a, b in zip(lrs, lrs[1:]))
    anchor = model.lr_anchor
    model.set_lr_horizon(152, 150)  # same horizon: nothing changes
    assert model.lr_anchor == anchor
    # a re-plan during the warmup anchors at its end, W = 10 kept though 30 // 2 = 15
    early = Eagle3Module("unused", optim=OptimConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1))
    early.set_lr_horizon(110, 3)
    early.set_lr_horizon(30, 5)
    assert early.lr_anchor == (10, 10, 0.0)
    assert [early.lr_factor(s) for s in range(11)] == [*plain[:10], 1.0] and early.lr_factor(30) == 0.1
    with pytest.raises(ValueError, match="horizon >= 1"):
        early.set_lr_horizon(0, 5)
    # checkpoint meta: lr_anchor is saved as a list and restored as a tuple; absent = the first plan
    meta = {"head_config": {}, "lr_horizon": 152, "lr_anchor": list(anchor), "tokens_trained": 0}
    fresh = Eagle3Module("unused", optim=OptimConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1))
    fresh.on_load_checkpoint({"draftkit": meta})
    assert (fresh.lr_horizon, fresh.lr_anchor) == (152, anchor)
    assert [fresh.lr_factor(s) for s in range(149, 155)] == [model.lr_factor(s) for s in range(149, 155)]
    fresh.on_load_checkpoint({"draftkit": {"head_config": {}, "lr_horizon": 110}})
    assert fresh.lr_anchor is None and [fresh.lr_factor(s) for s in range(121)] == plain


def test_checkpoint_records_the_trained_length_and_eagle3_1_options(tmp_path, monkeypatch):
    """fit 3 steps of the tiny recipe with an EAGLE-3.1 option: the checkpoint's head config carries it, and
    trained_length is the widest batch trained (its padded width = its longest row); resume restores it."""
    from pathlib import Path

    from draftkit.cli import DraftkitCLI

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    widths = []
    cli = DraftkitCLI(args=["--recipe", "recipes/tiny-debug.yaml", "--model.fc_norm", "true", "--model.norm_output",
                            "true", "--trainer.max_steps", "3", "--trainer.max_time", "null",
                            "--trainer.default_root_dir", str(tmp_path), "--data.hidden_states_cache", "null"], run=False)
    step = cli.model.training_step
    monkeypatch.setattr(cli.model, "training_step",
                        lambda batch, *a: widths.append(batch["input_ids"].shape[1]) or step(batch, *a))
    cli.trainer.fit(cli.model, cli.datamodule)
    ckpt = torch.load(next(tmp_path.rglob("last*.ckpt")), weights_only=False)
    meta = ckpt["draftkit"]
    assert meta["head_config"]["fc_norm"] and meta["head_config"]["norm_output"]
    assert not meta["head_config"]["norm_before_fc"]
    assert len(widths) == 3 and meta["trained_length"] == max(widths)
    fresh = type(cli.model)(**{k: v for k, v in cli.model.hparams.items() if not k.startswith("_")})
    fresh.on_load_checkpoint(ckpt)
    assert fresh.trained_length == max(widths)


def test_hidden_state_noise_perturbs_only_the_aux_states_of_training_batches(built_module):
    """model.hidden_state_noise s: uniform noise in [-s, s] on the aux states before fc (speculators'
    AddUniformNoise), reproducible per (seed, step, rank, batch index); the teacher and validation stay clean."""
    model, dm = built_module
    batch = next(iter(dm.train_dataloader()))
    model.eval()
    clean, _ = model.ttt_loss(batch, 3)
    model.train()
    assert float(model.ttt_loss(batch, 3)[0]) == float(clean)  # s = 0: nothing drawn, the same loss
    state = torch.random.get_rng_state()
    model.hparams.hidden_state_noise = 0.05
    aux = model.target(batch["input_ids"], attention_mask=batch["attention_mask"]).aux_hidden_states
    noise = model.aux_noise(aux, 3)
    assert noise.shape == aux.shape and noise.dtype == aux.dtype
    assert float(noise.abs().max()) <= 0.05 and float(noise.abs().max()) > 0.049
    assert float(noise.std()) == pytest.approx(0.05 / math.sqrt(3), rel=0.05)  # uniform on [-s, s]
    assert abs(float(noise.mean())) < 2e-3
    torch.testing.assert_close(model.aux_noise(aux, 3), noise, rtol=0, atol=0)  # the same step and batch
    assert not torch.equal(model.aux_noise(aux, 4), noise)  # another batch index: other noise
    noisy, _ = model.ttt_loss(batch, 3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global generator is not advanced
    assert float(noisy) != float(clean)
    # the same loss as a clean run whose teacher hands the head aux + noise: noise enters through aux only
    model.hparams.hidden_state_noise = 0.0
    teacher = model._teacher
    model._teacher = lambda b: (lambda a, last, head: (a + noise, last, head))(*teacher(b))
    torch.testing.assert_close(model.ttt_loss(batch, 3)[0], noisy, rtol=0, atol=0)
    model._teacher = teacher
    model.hparams.hidden_state_noise = 0.05
    model.eval()
    assert float(model.ttt_loss(batch, 3)[0]) == float(clean)  # validation: no noise


def test_hidden_state_noise_must_be_non_negative(tiny_target_dir):
    with pytest.raises(ValueError, match="model.hidden_state_noise must be >= 0"):
        Eagle3Module(str(tiny_target_dir), hidden_state_noise=-0.1)


# OptimConfig: the documented defaults that change a run's result (issue 36).


def test_optim_defaults():
    cfg = OptimConfig()
    assert (cfg.warmup_steps, cfg.weight_decay, cfg.betas, cfg.min_lr_ratio) == (50, 0.0, (0.9, 0.95), 0.1)


# Validation (issue 36): val/loss is logged as soon as TTT step 0 supervised any weight, one token included.


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_val_loss_logged_with_one_supervised_token(weight, tiny_target_dir, tiny_chat_jsonl, tmp_path):
    torch.manual_seed(0)
    dm = ChatDataModule(str(tiny_chat_jsonl), tokenizer=str(tiny_target_dir), max_length=64, val_size=2, batch_size=3)
    dm.setup("fit")
    model = Eagle3Module(str(tiny_target_dir), target_dtype="float32", draft_vocab_size=320, ttt={"steps": 1})
    model.build(dm)
    real, totals = model.ttt_loss, []

    def ttt_loss(batch, batch_idx=0):  # validation: step 0's weighted count is `weight` (one token, or half of one)
        total, stats = real(batch, batch_idx)
        if not model.training:
            loss_sum, correct_sum, w_sum, scored = stats[0]
            stats = [(loss_sum / w_sum * weight, correct_sum / w_sum * weight, w_sum / w_sum * weight,
                      scored / scored * weight)]
            totals.append(float(total))
        return total, stats

    model.ttt_loss = ttt_loss
    _, rows = _fit(model, dm, tmp_path, "val/loss", max_steps=1, val_check_interval=1, limit_val_batches=1)
    logged = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(totals) == 1 and logged == pytest.approx(totals, rel=1e-6)  # one validation batch: its loss


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.03])
def test_every_optimizer_group_carries_the_configured_decay_and_betas(full_vocab_module, optimizer, weight_decay):
    """No group falls back to a library default (AdamW's 0.01, Muon's 0.1): 0.0 is the separating value; every
    trainable head parameter is in exactly one group (issue 56)."""
    from types import SimpleNamespace

    model = full_vocab_module
    model.optim = OptimConfig(lr=1e-3, optimizer=optimizer, weight_decay=weight_decay, betas=(0.8, 0.9))
    model._trainer = SimpleNamespace(estimated_stepping_batches=20)
    opt = model.configure_optimizers()["optimizer"]
    assert [g["weight_decay"] for g in opt.param_groups] == [weight_decay] * len(opt.param_groups)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-3 / 10] * len(opt.param_groups))  # W = 10 (half of 20)
    for g in opt.param_groups:
        if not g.get("muon", False):
            assert tuple(g["betas"]) == (0.8, 0.9)
    grouped = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.head.parameters() if p.requires_grad)
