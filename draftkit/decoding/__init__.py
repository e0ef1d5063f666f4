"""Decoding with draft heads (token sampling and ``DecodeConfig`` live one floor down, in ``draftkit.sampling``).

- ``drafters``: the ``Drafter`` protocol, the EAGLE3 head as a chain drafter (with its own KV cache) and
  prompt-lookup drafting.
- ``verify``: greedy and rejection-sampling acceptance, the round loop, plain and chain speculative decoding over
  the target's KV-cache session (``draftkit.target.session.TargetSession``), an uncached reference.
- ``tree``: tree drafting (EAGLE-2's rule), one tree-masked target verify, greedy path acceptance and
  multi-draft rejection sampling, cache compaction; a chain is the tree with top-k 1.
- ``cost``: the cost model that picks chain k or tree (depth, top-k, N) from measured costs and a greedy
  calibration, or plain decoding when nothing pays (``evaluate --k auto`` / ``--tree auto``).
- ``metrics``: acceptance length tau, per-position acceptance, acceptance rate, KL(target || draft).
- ``harness``: :func:`~draftkit.decoding.harness.evaluate_head`, the harness of ``draftkit evaluate`` and the
  ``AcceptanceLengthMonitor`` callback.
- ``lossless``: evaluate's lossless check: speculative greedy output equals plain greedy output in float32, for
  every topology that ran.
- ``report``: the text summary, TensorBoard scalars and figures of an evaluate report.
- ``bench``: decode-speed measurement behind ``draftkit bench decode`` (per-round costs, speedup at a scripted
  acceptance).
"""
