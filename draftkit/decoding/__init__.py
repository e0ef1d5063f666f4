"""Decoding with draft heads.

- ``sampling``: temperature / top-k / top-p warping and sampling (temperature 0 = greedy).
- ``speculative``: plain decoding with the target KV cache, chain speculative decoding (EAGLE3 head with its
  own KV cache, greedy or rejection-sampling acceptance), prompt-lookup drafting, an uncached reference.
- ``tree``: tree drafting (EAGLE-2's rule), one tree-masked target verify, greedy path acceptance and
  multi-draft rejection sampling, cache compaction; a chain is the tree with top-k 1.
- ``cost``: the cost model that picks chain k or tree (depth, top-k, N) from measured costs and a greedy
  calibration, or plain decoding when nothing pays (``evaluate --k auto`` / ``--tree auto``).
- ``metrics``: acceptance length tau, per-position acceptance, acceptance rate, KL(target || draft).
- ``evaluate``: ``python -m draftkit evaluate`` and :func:`~draftkit.decoding.evaluate.evaluate_head`.
- ``bench``: decode-speed benchmark (per-round costs, speedup at a scripted acceptance).
- ``dual_precision``: gated dual-precision drafting (see its module).
"""
