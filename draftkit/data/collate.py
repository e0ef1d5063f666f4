"""Batch collation: right-pad tokenized rows (online) or cached rows with their hidden states (offline).

Shapes: B sequences, T tokens, n_aux aux layers, H_t target hidden.
"""

from __future__ import annotations

import torch

__all__ = ["SUPERVISE", "collate", "collate_offline", "row_source"]

SUPERVISE = ("assistant", "all")


def collate(rows: list[dict], pad_token_id: int = 0, supervise: str = "assistant") -> dict[str, torch.Tensor]:
    """Right-pad tokenized rows into a batch.

    Args:
        rows: dicts with ``input_ids`` and ``loss_mask`` lists of equal length.
        pad_token_id: id written into padding (masked out by ``attention_mask``).
        supervise: ``assistant`` = ``loss_mask`` as tokenized (assistant tokens); ``all`` = every real token
            (``loss_mask`` = ``attention_mask``): the head then also learns the target's distribution at user
            and template positions (the labels are the target's own probabilities either way).

    Returns:
        ``input_ids``, ``attention_mask``, ``loss_mask``: (B, T) int64; and ``source``, B strings naming where
        each row came from (:func:`row_source`), when the rows carry a ``source`` or ``record`` field (the
        training module names them when a batch's loss is non-finite).

    Raises:
        ValueError: on an unknown ``supervise``.
    """
    if supervise not in SUPERVISE:
        raise ValueError(f"data.supervise must be one of {', '.join(SUPERVISE)}, got {supervise!r}")
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"])
        attn[i, :n] = 1
        mask[i, :n] = 1 if supervise == "all" else torch.as_tensor(r["loss_mask"])
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}
    sources = [row_source(r) for r in rows]
    if any(s is not None for s in sources):
        batch["source"] = [s or "an unnamed row" for s in sources]
    return batch


def row_source(row: dict) -> str | None:
    """Where a row came from, for error messages: its ``source`` (an offline cache row names its shard file and
    sequence), else ``record <name>`` from a ``record`` field (the data file's record name), else None."""
    if row.get("source"):
        return str(row["source"])
    if row.get("record"):
        return f"record {row['record']}"
    return None


def collate_offline(rows: list[dict], pad_token_id: int = 0, supervise: str = "assistant") -> dict[str, torch.Tensor]:
    """Right-pad cached rows into a batch: the ``collate`` keys (``supervise`` as there) plus the hidden states.

    Returns:
        ``input_ids``, ``attention_mask``, ``loss_mask`` (B, T) int64; ``aux_hidden_states``
        (B, T, n_aux*H_t) and ``last_hidden_state`` (B, T, H_t) bf16, zero on padding; ``source`` (B strings:
        shard file and sequence of each row) when the rows carry it (``OfflineDataset`` items do).
    """
    batch = collate(rows, pad_token_id, supervise)
    b, t = batch["input_ids"].shape
    for key in ("aux_hidden_states", "last_hidden_state"):
        out = rows[0][key].new_zeros((b, t, rows[0][key].shape[-1]))  # (B, T, width)
        for i, r in enumerate(rows):
            out[i, : r[key].shape[0]] = r[key]
        batch[key] = out
    return batch
