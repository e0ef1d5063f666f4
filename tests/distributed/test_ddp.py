"""DDP on CPU (2 processes over gloo) trains the same head as one process with the same global batch, with the
target replicated (``ddp``) or sharded with FSDP2 (``fsdp_target``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftkit.artifacts import resolve_artifact
from draftkit.cli import DraftkitCLI
from draftkit.commands import main as draftkit_main

REPO = Path(__file__).resolve().parents[2]
RECIPE = "recipes/tiny-debug.yaml"


def _override(root: Path, max_steps: int, callbacks: tuple = ()) -> Path:
    cfg = {
        "trainer": {
            "default_root_dir": str(root), "max_steps": max_steps, "limit_val_batches": 0,
            "enable_progress_bar": False, "logger": False,
            "callbacks": [{
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"dirpath": str(root / "ckpt"), "monitor": None, "every_n_train_steps": 2,
                              "save_top_k": -1, "save_last": True},
            }, *callbacks],
        },
        "data": {"bucket_window": 16},
    }
    path = root / "override.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def _head(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("head.") and v.is_floating_point()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def test_two_process_ddp_equals_one_process(tmp_path, monkeypatch):
    """2 processes x batch 2 (DDP, gloo) and 1 process x batch 4 see the same sequences at every step
    (length-bucketed, seeded), and the loss is normalised by the global supervised count, so after 4 AdamW
    steps the head weights agree to fp32 reduction-order noise: tolerance 1e-5 absolute (measured ~1e-7),
    while training moves them by > 1e-3. Resuming one process from the DDP run's step-2 checkpoint (its data
    position counts global batches) reaches the same weights again.
    """
    monkeypatch.chdir(REPO)
    # build the tiny target first: building it re-seeds the global RNG, which would change the head's
    # initialisation in whichever run builds it
    resolve_artifact("tiny:llama")
    ddp, single, resumed = tmp_path / "ddp", tmp_path / "single", tmp_path / "resumed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "draftkit", "fit", "--recipe", RECIPE, "--recipe", str(_override(ddp, 4)),
         "--trainer.devices", "2", "--trainer.strategy", "ddp", "--data.batch_size", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    DraftkitCLI(args=["fit", "--recipe", RECIPE, "--recipe", str(_override(single, 4)), "--data.batch_size", "4"])
    step2 = next((ddp / "ckpt").glob("*step=2*.ckpt"))
    DraftkitCLI(args=["fit", "--recipe", RECIPE, "--recipe", str(_override(resumed, 4)), "--data.batch_size", "4",
                      "--ckpt_path", str(step2)])

    two, one, again = (_head(d / "ckpt" / "last.ckpt") for d in (ddp, single, resumed))
    initial = _head(next((single / "ckpt").glob("*step=2*.ckpt")))
    assert _max_diff(two, one) < 1e-5
    assert _max_diff(again, one) < 1e-5
    assert _max_diff(initial, one) > 1e-3  # the weights did move between step 2 and step 4
    saved = torch.load(ddp / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 4


def _skip_data(tmp_path: Path, kind: str) -> Path:
    """9 records of recipes/data/tiny-chat.jsonl with one unreadable record (the x21 case): line 5 of a JSONL
    file is not JSON, or record 4 of a JSON array is a string."""
    good = [json.loads(line) for line in (REPO / "recipes/data/tiny-chat.jsonl").read_text().splitlines()[:8]]
    if kind == "json":
        path = tmp_path / "skip.json"
        path.write_text(json.dumps(good[:4] + ["not a record"] + good[4:]))
    else:
        path = tmp_path / "skip.jsonl"
        lines = [json.dumps(r) for r in good]
        path.write_text("\n".join(lines[:4] + ["{not json"] + lines[4:]) + "\n")
    return path


SKIPPED = {
    "json": {"record": "record 4", "reason": "not an object", "detail": "record is string, not an object"},
    "jsonl": {"record": "line 5", "reason": "corrupt JSON line",
              "detail": "Expecting property name enclosed in double quotes at column 2"},
}


@pytest.mark.parametrize("kind", ["json", "jsonl", "offline"])
def test_two_process_ddp_with_a_skipped_record_finishes(tmp_path, kind):
    """Case x21: a 2-process DDP run whose data has one skipped record used to hang at set-up (global rank 0
    alone reached ``trainer.log_dir``, a broadcast, while writing the skip list). Now it trains its 2 steps
    (with a validation at step 2) over JSON, JSONL and the offline hidden-state cache (``auto``: each rank
    writes its share, both ranks train from it), and the skip list names the one record."""
    data = _skip_data(tmp_path, "jsonl" if kind == "offline" else kind)
    root = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "DRAFTKIT_CACHE": os.environ.get("DRAFTKIT_CACHE", str(tmp_path / "cache"))}
    cmd = [sys.executable, "-m", "draftkit", "fit", "--recipe", RECIPE, "--data.path", str(data),
           "--data.val_size", "2", "--data.batch_size", "1", "--trainer.devices", "2", "--trainer.strategy", "ddp",
           "--trainer.check_val_every_n_epoch", "null", "--trainer.val_check_interval", "2",
           "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
           "--trainer.default_root_dir", str(root)]
    if kind == "offline":
        cmd += ["--data.hidden_states_cache", "auto"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"2-process run with a skipped record hung (no exit in {exc.timeout} s)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = root / "lightning_logs" / "version_0"
    skips = json.loads((run_dir / "skipped_records.json").read_text())
    assert skips == [SKIPPED["jsonl" if kind == "offline" else kind]]
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 2
    if kind == "offline":
        assert "offline mode: target states from" in proc.stderr


def _recorders(root: Path, prompts: Path) -> tuple:
    """Callbacks of the sharded-target test: each step's losses and head gradients (``step_recorder``), and the
    acceptance monitor at steps 2 and 4."""
    return (
        {"class_path": "tests.distributed.step_recorder.StepRecorder", "init_args": {"out": str(root / "steps")}},
        {"class_path": "draftkit.callbacks.acceptance.AcceptanceLengthMonitor",
         "init_args": {"every_n_train_steps": 2, "num_prompts": 2, "k": 3, "max_new_tokens": 8, "prompts": str(prompts)}},
    )


def test_sharded_target_equals_one_process(tmp_path, monkeypatch):
    """2 processes x batch 2 with the target sharded (``fsdp_target``) and 1 process x batch 4 with the whole
    target see the same sequences at every step. For each of 4 AdamW steps the mean of the ranks' losses equals
    the 1-process loss and the head's all-reduced gradients equal its gradients to 1e-5 (fp32 reduction-order
    noise), while each rank holds about half of the target's bytes; the acceptance monitor (speculative decoding
    on the sharded target, every rank in lockstep) measures the same acceptance lengths. The sharded run's
    checkpoints hold the head only (no target tensor); resumed from its step-2 checkpoint, sharded again or in one
    process, they reach the uninterrupted run's weights; they export and evaluate like the 1-process run's.
    """
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO))  # the recorder callback, by its class path
    resolve_artifact("tiny:llama")  # built first: building it re-seeds the global RNG
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    resumed, resumed_sharded = tmp_path / "resumed", tmp_path / "resumed-sharded"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(["Name three primary colors.", "What is 2+2?"])))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "draftkit", "fit", "--recipe", RECIPE,
         "--recipe", str(_override(sharded, 4, _recorders(sharded, prompts))),
         "--trainer.devices", "2", "--trainer.strategy", "fsdp_target", "--data.batch_size", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    DraftkitCLI(args=["fit", "--recipe", RECIPE, "--recipe", str(_override(single, 4, _recorders(single, prompts))),
                      "--data.batch_size", "4"])

    ranks = [torch.load(sharded / "steps" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    one = torch.load(single / "steps" / "rank0.pt", weights_only=False)
    assert len(one["losses"]) == len(one["grads"]) == 4
    for step in range(4):
        mean_loss = (ranks[0]["losses"][step] + ranks[1]["losses"][step]) / 2
        assert abs(mean_loss - one["losses"][step]) < 1e-5, (step, mean_loss, one["losses"][step])
        for rank in ranks:
            assert _max_diff(rank["grads"][step], one["grads"][step]) < 1e-5
    # the acceptance monitor decoded on both ranks in lockstep (the sharded target's forwards are collective)
    # and measured what one process measures, at steps 2 and 4
    assert [s for s, _ in one["accept_len"]] == [2, 4]
    for rank in ranks:
        assert rank["accept_len"] == one["accept_len"]
    # each rank holds half of every weight (rows padded to an even count) and the buffers (RoPE frequencies)
    whole = one["target_bytes"]
    for rank in ranks:
        assert 0.49 * whole < rank["target_bytes"] < 0.51 * whole, (rank["target_bytes"], whole)

    step2 = next((sharded / "ckpt").glob("*step=2*.ckpt"))
    DraftkitCLI(args=["fit", "--recipe", RECIPE, "--recipe", str(_override(resumed, 4, _recorders(resumed, prompts))),
                      "--data.batch_size", "4", "--ckpt_path", str(step2)])
    proc = subprocess.run(
        [sys.executable, "-m", "draftkit", "fit", "--recipe", RECIPE,
         "--recipe", str(_override(resumed_sharded, 4, _recorders(resumed_sharded, prompts))),
         "--trainer.devices", "2", "--trainer.strategy", "fsdp_target", "--data.batch_size", "2",
         "--ckpt_path", str(step2)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {"sharded": sharded, "single": single, "resumed": resumed, "resumed_sharded": resumed_sharded}
    last = {name: d / "ckpt" / "last.ckpt" for name, d in runs.items()}
    saved = torch.load(last["sharded"], map_location="cpu", weights_only=False)
    assert saved["global_step"] == 4
    assert not [k for k in saved["state_dict"] if k.startswith("target.")]
    assert _max_diff(_head(last["sharded"]), _head(last["single"])) < 1e-5
    assert _max_diff(_head(last["resumed"]), _head(last["single"])) < 1e-5
    assert _max_diff(_head(last["resumed_sharded"]), _head(last["single"])) < 1e-5
    assert _max_diff(_head(step2), _head(last["single"])) > 1e-3  # the weights moved between step 2 and 4

    exported = {}
    for name in ("sharded", "single"):
        out = tmp_path / f"export-{name}"
        assert draftkit_main(["export", str(last[name]), str(out), "--to", "vllm", "--dtype", "float32"]) == 0
        exported[name] = load_file(str(next(out.glob("*.safetensors"))))
    assert _max_diff(exported["sharded"], exported["single"]) < 1e-5

    reports = {}
    for name in ("sharded", "single"):
        report = tmp_path / f"eval-{name}.json"
        assert draftkit_main(["evaluate", "--checkpoint", str(last[name]), "--output", str(report), "--prompts",
                              str(prompts), "--k", "3", "--max_new_tokens", "16"]) == 0
        reports[name] = json.loads(report.read_text())
    for key in ("tau", "acceptance_per_position"):
        assert reports["sharded"][key] == reports["single"][key]
