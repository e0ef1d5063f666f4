"""Data made by running the target: ``regenerate`` (``draftkit generate``: the target answers every assistant turn,
so a head trains on the target's own path).

Floor 2 (architecture.md "Floors"): it reads the training-data formats of ``draftkit.data`` and runs the target of
``draftkit.target``; ``draftkit.data`` does not import it. The hidden-state writer (``cache-hidden-states``, fit's
``hidden_states_cache: auto``) still lives in ``draftkit.data.hidden_cache``: the datamodule calls it.
"""
