"""Layer analysis: streaming covariance, matrix entropy, CKA, token prediction entropy, aux-layer choice.

The maths re-exported here is pure torch (floor 1 of the import layering); ``collect`` (the streaming pass
over a target) and ``report`` (the report of ``select-layers`` and ``LayerSelection``) sit on floor 3 and are
imported from their modules. See layer-analysis.md. Ids are HF ``hidden_states`` indices throughout (id k =
input of decoder layer k).
"""

from draftkit.analysis.cka import MinibatchCKA, cka_from_cross, hsic1_features, hsic1_gram, linear_cka
from draftkit.analysis.entropy import entropy_h1, entropy_h2, h2_concat_closed_form
from draftkit.analysis.moments import LayerMoments
from draftkit.analysis.subsets import Selection, cka_blocks, select_subsets
from draftkit.analysis.token_entropy import entropy_filter_weights, token_entropy

__all__ = [
    "LayerMoments",
    "MinibatchCKA",
    "Selection",
    "cka_blocks",
    "cka_from_cross",
    "entropy_filter_weights",
    "entropy_h1",
    "entropy_h2",
    "h2_concat_closed_form",
    "hsic1_features",
    "hsic1_gram",
    "linear_cka",
    "select_subsets",
    "token_entropy",
]
