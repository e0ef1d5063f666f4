"""Layer analysis: streaming covariance, matrix entropy, CKA, token prediction entropy, aux-layer choice.

Pure torch (layer 1 of the import layering); see ``docs``: layer-analysis.md. Ids are HF ``hidden_states``
indices throughout (id k = input of decoder layer k).
"""

from draftkit.analysis.cka import MinibatchCKA, cka_from_cross, hsic1_features, hsic1_gram, linear_cka
from draftkit.analysis.collect import LayerAnalysisConfig, LayerStatistics, collect_layer_statistics
from draftkit.analysis.entropy import entropy_h1, entropy_h2, h2_concat_closed_form
from draftkit.analysis.moments import LayerMoments
from draftkit.analysis.subsets import Selection, cka_blocks, select_subsets
from draftkit.analysis.token_entropy import entropy_filter_weights, token_entropy

__all__ = [
    "LayerAnalysisConfig",
    "LayerMoments",
    "LayerStatistics",
    "MinibatchCKA",
    "Selection",
    "cka_blocks",
    "cka_from_cross",
    "collect_layer_statistics",
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
