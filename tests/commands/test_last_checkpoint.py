"""``last.ckpt`` holds the final optimizer step even when the monitored metric falls (issue 30 item 3)."""

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_last_ckpt_holds_final_step(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "draftkit", "fit", "--recipe", str(ROOT / "recipes/tiny-debug.yaml"),
         "--trainer.max_steps", "12", "--data.path", str(ROOT / "recipes/data/tiny-chat.jsonl")],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    last = tmp_path / "checkpoints/tiny-debug/lightning_logs/version_0/checkpoints/last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 12
    assert "last.ckpt (step 12)" in out.stdout + out.stderr
