"""Token sampling for decoding: temperature, top-k and top-p (nucleus) warping of logits, and
:class:`DecodeConfig` (what to generate and how to pick tokens).

Floor 1 (architecture.md "Floors"): decoding, dual precision and data regeneration (``draftkit.generation.regenerate``)
all pick tokens here, so none of them imports another for it.

Temperature 0 means greedy (argmax); :func:`probs_from_logits` then returns the one-hot distribution of
the argmax, so that speculative rejection sampling at temperature 0 reduces to greedy acceptance.
The same warping is applied to the target and to the draft in speculative sampling, which keeps the
output distribution equal to plain sampling from the warped target (arXiv 2211.17192, 2302.01318).

Shapes: V vocabulary (target V or draft V_d), ``...`` any leading dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DecodeConfig", "NonFiniteLogitsError", "check_finite_logits", "check_sampling", "probs_from_logits", "sample",
    "sample_from_probs",
]


class NonFiniteLogitsError(ValueError):
    """Logits with NaN or inf reached a sampler: their argmax or draw would be an arbitrary token, silently.

    Attributes:
        position: index tuple of the first non-finite value (last entry: the vocabulary id).
        dtype: the logits' dtype name (``float32``, ``bfloat16``, ...).
    """

    def __init__(self, message: str, position: tuple[int, ...] = (), dtype: str = "") -> None:
        super().__init__(message)
        self.position, self.dtype = tuple(position), dtype


def check_finite_logits(logits: torch.Tensor, what: str = "logits") -> None:
    """Refuse logits holding NaN or inf (one ``isfinite(...).all()``; the error path finds the first one).

    Args:
        logits: (..., V) any float dtype.
        what: names the logits in the error (e.g. ``target logits``, ``draft logits at draft position 2``).

    Raises:
        NonFiniteLogitsError: naming the count, the dtype and the position (index tuple, the last entry the
            vocabulary id) and value of the first non-finite entry.
    """
    if not logits.is_floating_point() or bool(torch.isfinite(logits).all()):
        return
    bad = ~torch.isfinite(logits)
    position = tuple(int(i) for i in bad.nonzero()[0])
    dtype = str(logits.dtype).removeprefix("torch.")
    where = f"vocab id {position[-1]}" if len(position) == 1 else f"row {position[:-1]}, vocab id {position[-1]}"
    raise NonFiniteLogitsError(
        f"non-finite {what}: {int(bad.sum())} of {logits.numel()} values ({dtype}) are NaN/inf, first at position "
        f"{list(position)} ({where}) = {float(logits[position])}; "
        + (f"{dtype} arithmetic may have overflowed: run the model in float32, or check its weights"
           if logits.dtype in (torch.bfloat16, torch.float16) else "check the model's weights and inputs"),
        position, dtype,
    )


def check_sampling(temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
    """Validate sampling options.

    Args:
        temperature: >= 0; 0 = greedy.
        top_k: >= 0; 0 = no top-k cut.
        top_p: in (0, 1]; 1 = no nucleus cut.

    Raises:
        ValueError: naming the option and the bad value.
    """
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")


def probs_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, check: bool = True
) -> torch.Tensor:
    """Sampling distribution of logits after temperature, top-k and top-p warping.

    Steps: 1. divide by the temperature; 2. keep the ``top_k`` largest logits (ties at the k-th value are
    kept); 3. keep the smallest set of most probable tokens whose mass reaches ``top_p`` (the token that
    crosses the threshold is kept, as in Hugging Face ``TopPLogitsWarper``); 4. softmax in float32.

    Args:
        logits: (..., V) any float dtype.
        temperature: >= 0; 0 returns the one-hot distribution of the argmax (first index on ties).
        top_k: 0 = off.
        top_p: 1 = off.
        check: False skips the finiteness check (a host read) for a caller that checks many rows at once later.

    Returns:
        (..., V) float32 probabilities that sum to 1 over V.

    Raises:
        ValueError: on a bad option (see :func:`check_sampling`).
        NonFiniteLogitsError: on NaN/inf logits (:func:`check_finite_logits`), when ``check``.
    """
    check_sampling(temperature, top_k, top_p)
    if check:
        check_finite_logits(logits)
    return _warp(logits, temperature, top_k, top_p)


def _warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """:func:`probs_from_logits` without the checks."""
    if temperature == 0:
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    z = logits.float() / temperature  # (..., V)
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]  # (..., 1)
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)  # (..., V)
        sorted_p = sorted_z.softmax(-1)
        # drop a token when the mass of the strictly more probable ones already reaches top_p
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # (..., V)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)  # back to vocab order
        z = z.masked_fill(drop, float("-inf"))
    return z.softmax(-1)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one id per row of a distribution.

    Args:
        probs: (..., V) non-negative, each row with positive mass (need not be normalised).
        generator: torch RNG for reproducible draws (None = global RNG).

    Returns:
        (...) int64 ids.
    """
    flat = probs.reshape(-1, probs.shape[-1])  # (prod(...), V)
    ids = torch.multinomial(flat, 1, generator=generator)  # (prod(...), 1)
    return ids.reshape(probs.shape[:-1])


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick the next token from logits: argmax at temperature 0, else a draw from :func:`probs_from_logits`.

    Args:
        logits: (..., V).
        temperature: >= 0; 0 = greedy.
        top_k: 0 = off.
        top_p: 1 = off.
        generator: torch RNG (None = global RNG); unused when greedy.

    Returns:
        (...) int64 token ids.

    Raises:
        ValueError: on a bad option (see :func:`check_sampling`).
        NonFiniteLogitsError: on NaN/inf logits, naming the first one's position (:func:`check_finite_logits`);
            ``argmax`` would return a NaN's index.
    """
    check_sampling(temperature, top_k, top_p)
    check_finite_logits(logits)
    if temperature == 0:
        return logits.argmax(-1)
    return sample_from_probs(_warp(logits, temperature, top_k, top_p), generator)


@dataclass
class DecodeConfig:
    """What to generate and how to pick tokens.

    Args:
        max_new_tokens: stop after this many new tokens (>= 1).
        temperature: >= 0; 0 = greedy.
        top_k: 0 = off.
        top_p: 1 = off.
        eos_token_ids: stop after emitting any of these ids (the stop token is kept in the output).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_sampling(self.temperature, self.top_k, self.top_p)
        self.eos_token_ids = tuple(int(i) for i in self.eos_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
