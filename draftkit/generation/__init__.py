"""Data made by running the target: ``regenerate`` (``draftkit generate``: the target answers every assistant turn,
so a head trains on the target's own path) and ``hidden_states`` (the offline hidden-state cache writer behind
``draftkit cache-hidden-states`` and fit's ``hidden_states_cache: auto``).

Floor 2 (architecture.md "Floors"): it reads the training-data formats of ``draftkit.data`` (the hidden-state
cache's format and reader are ``draftkit.data.hidden_cache``) and runs the target of ``draftkit.target``;
``draftkit.data`` does not import it.
"""
