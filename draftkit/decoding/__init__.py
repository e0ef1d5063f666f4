"""Decoding with draft heads.

- ``sampling``: temperature / top-k / top-p warping and sampling (temperature 0 = greedy).
- ``speculative``: plain decoding with the target KV cache, chain speculative decoding (EAGLE3 head with its
  own KV cache, greedy or rejection-sampling acceptance), prompt-lookup drafting, an uncached reference.
- ``metrics``: acceptance length tau, per-position acceptance, acceptance rate, KL(target || draft).
- ``evaluate``: ``python -m draftkit evaluate`` and :func:`~draftkit.decoding.evaluate.evaluate_head`.
- ``bench``: decode-speed benchmark (per-round costs, speedup at a scripted acceptance).
- ``dual_precision``: gated dual-precision drafting (see its module).
"""
