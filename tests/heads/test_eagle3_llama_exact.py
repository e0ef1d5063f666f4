"""draftkit.heads.eagle3_llama.Eagle3Config defaults that change the head's output (issue 36)."""

from draftkit.heads.eagle3_llama import Eagle3Config


def test_config_defaults():
    cfg = Eagle3Config(target_hidden_size=8, hidden_size=8, num_aux_layers=3, intermediate_size=16, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4, vocab_size=32, draft_vocab_size=16)
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.rope) == (1e-5, 8192, {"rope_theta": 10000.0})
