"""Runs in speculators' own environment (not draftkit's): load a speculators-format export with speculators'
``Eagle3DraftModel.from_pretrained`` and write its draft logits for fixed inputs.

Used by ``test_interop_speculators.py``; it imports nothing from draftkit. speculators 0.9.0
(``src/speculators/models/eagle3/core.py``): ``from_pretrained`` reads config.json and model.safetensors, then
``load_verifier_weights`` takes ``embed_tokens`` from the verifier named in ``speculators_config.verifier``
(the target directory here; under transformers 5.19 only with ``overwrite_embed_tokens``, see below).
``forward`` returns only the argmax draft tokens per TTT step, so the logits are read off ``lm_head`` with a
forward hook (one call per step; step 0 reads fc(aux), step 1 the previous step's output, or its norm with
``norm_output``, with the teacher-forced ids shifted by one).

Usage: ``python speculators_logits.py EXPORT_DIR INPUTS.pt OUT.pt [TTT_STEPS]``. INPUTS.pt holds ``aux``
(1, T, n*H_t) float32 (the n aux hidden states concatenated in layer order), ``input_ids`` (1, T) int64 and
``position_ids`` (1, T) int64. OUT.pt gets ``logits``: TTT_STEPS (default 2) tensors (1, T, V_d) float32,
and the model's ``d2t`` / ``t2d`` buffers (None when V_d == V).
"""

from __future__ import annotations

import sys

import torch
from speculators.models.eagle3 import Eagle3DraftModel


def main(export_dir: str, inputs_path: str, out_path: str, ttt_steps: int = 2) -> None:
    inputs = torch.load(inputs_path)
    model = Eagle3DraftModel.from_pretrained(export_dir, dtype=torch.float32).eval()
    # Under transformers 5.19 from_pretrained initialises the missing embed_tokens, so its NaN check skips the
    # verifier's embedding: load it as speculators' DFlash does (its own loader, overwriting).
    model._load_verifier_weights(overwrite_embed_tokens=True)  # noqa: SLF001
    logits = []
    model.lm_head.register_forward_hook(lambda _mod, _args, out: logits.append(out.detach().float().clone()))
    ids = inputs["input_ids"]
    with torch.no_grad():
        model(hidden_states=inputs["aux"], input_ids=ids, document_ids=torch.zeros_like(ids),
              position_ids=inputs["position_ids"], ttt_steps=ttt_steps)
    torch.save({"logits": logits, "d2t": model.d2t, "t2d": model.t2d,
                "norm_flags": {f: bool(getattr(model.config, f)) for f in
                               ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:5]))
