"""draftkit's Lightning callbacks, installed as ``draftkit.callbacks`` (the folder is ``callbacks/`` at the
repository root). YAML ``class_path`` values use ``draftkit.callbacks.<module>.<Class>``; the bundle
``default.yaml`` ships as package data."""
