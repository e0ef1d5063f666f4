"""Kernels: the fast forms of the target's and the draft head's arithmetic, each beside the plain reference it is
tested against.

- ``attention``: grouped-query attention with the query groups folded into rows (decode steps, verifies, trees);
- ``decode_attention``: that attention registered in transformers' attention interface for a target;
- ``ttt_attention``: the draft head's training-time-test attention (O(T) memory, its own backward), and the
  FlexAttention form (``ttt_attention_flex``), a CUDA candidate that ``benchmarks/gpu_check.py`` measures;
- ``linears``: the CPU probe and the packed (and fused) oneDNN linear weights;
- ``compile``: the target's decoder stack compiled by ``torch.compile`` (floor 2: it warms up a target session);
- ``option``: the ``--kernels`` option: one check and one handle that applies and releases a choice (floor 2).
"""
