"""Decoding with draft heads.

- ``sampling``: temperature / top-k / top-p warping and sampling (temperature 0 = greedy).
- ``speculative``: plain decoding with the target KV cache, chain speculative decoding (EAGLE3 head with its
  own KV cache, greedy or rejection-sampling acceptance), prompt-lookup drafting, an uncached reference.
- ``metrics``: acceptance length tau, per-position acceptance, acceptance rate, KL(target || draft).
- ``harness``: :func:`~draftkit.decoding.harness.evaluate_head`, the harness of ``draftkit evaluate`` and the
  ``AcceptanceLengthMonitor`` callback.
- ``bench``: decode-speed measurement behind ``draftkit bench decode`` (per-round costs, speedup at a scripted
  acceptance).
"""
