"""Streaming collection of every candidate layer's states over a target's forward passes (layer-analysis.md §1-§3, §7).

For each batch the target runs once; forward hooks capture ``hidden_states[1..N-1]`` (id k = input of decoder
layer k), and the rows to analyse are chosen, filtered and folded into fp64 statistics. One position set
is used for all layers: a row dropped for any reason is dropped from every layer.

Rows. By default (``rows="draft"``) row p is a draft row of TTT step 0 that is supervised: p + 2 < L and
m_{p+2} = 1 (eagle3-format.md §4.1), i.e. the aux states that feed the prediction of an assistant token.
``rows="mask"`` takes the positions with m_p = 1 (and p + 1 < L) instead.

Filters, applied in this order and counted (§2, §7):

1. padding (``attention_mask``), ids in ``exclude_token_ids`` (BOS), and the first ``skip_first`` positions;
2. attention-sink / massive-activation rows: a row whose largest |entry| at any candidate layer exceeds
   ``sink_factor`` times that layer's median row maximum (medians from the first ``warmup_rows`` rows;
   Sun et al., arXiv 2402.17762);
3. token prediction entropy: the key of row p is H_{p+1} (``entropy_key="next"``, the difficulty of the
   draft's own target) or H_p (``"self"``); rows with key below the threshold (absolute, or a quantile of the
   warm-up keys) are dropped.

Preprocessing: row-normalise (z̃ = z / ‖z‖₂), then center inside the moment accumulators (§3).

Statistics. Per-layer H1/H2 always come from fp64 moments over every kept row. CKA is exact (all cross
moments) when P·d is small (``cka="auto"``); otherwise it is minibatch HSIC1 CKA over a uniform reservoir
sample of ``cka_rows`` rows drawn across the whole stream, shuffled before it is cut into minibatches. A
uniform sample matters: neighbouring rows of one sequence are correlated, and on SmolLM2/ShareGPT
(12k rows, 12 sequences) minibatches cut from a shuffled pool of only 4 minibatches of consecutive rows
(a few sequences) differed from the exact CKA by up to 0.02-0.11 (n_b 1024-128), rows in stream order by up
to 0.14, while minibatches of rows shuffled across all sequences stayed within 0.005 for n_b 128-1024.
The same reservoir rows serve the exact re-rank by H1(S) (§5.2b).

Shapes: B batch, T tokens, N target layers, P = N - 1 candidates, d = H_t, n rows, V target vocab.
"""

from __future__ import annotations

import logging
import math
import time
import dataclasses
from dataclasses import dataclass, field

import torch

from draftkit.analysis.cka import MinibatchCKA
from draftkit.analysis.entropy import concat_entropies_from_rows
from draftkit.analysis.moments import LayerMoments
from draftkit.analysis.token_entropy import quantile_threshold, token_entropy
from draftkit.target.frozen import capture_hidden_states, target_logits, text_config

__all__ = [
    "LayerAnalysisConfig",
    "LayerStatistics",
    "LayerStatsCollector",
    "collect_layer_statistics",
]

log = logging.getLogger(__name__)


@dataclass
class LayerAnalysisConfig:
    """Options of the layer analysis (defaults as in layer-analysis.md unless stated)."""

    num_tokens: int = 100_000
    """Candidate rows to scan (after the padding/BOS/leading-position rules, before the sink and entropy filters)."""
    k: int = 3
    """Aux layers to choose."""
    entropy_quantile: float | None = None
    """Drop rows whose entropy key is below this quantile of the warm-up keys (0.5 keeps about half); None = off."""
    entropy_threshold: float | None = None
    """Or: drop rows whose entropy key is below this many nats; None = off."""
    entropy_sweep: list[float] = field(default_factory=list)
    """More quantiles analysed in the same pass (each with its own statistics and choice), e.g. [0.5, 0.8]."""
    entropy_key: str = "next"
    """``next``: key of row p is H_{p+1} (the draft's own target); ``self``: H_p."""
    rows: str = "draft"
    """``draft``: rows p with m_{p+2} = 1 (supervised at TTT step 0); ``mask``: rows p with m_p = 1."""
    skip_first: int = 1
    """Drop the first positions of each sequence."""
    sink_factor: float | None = 100.0
    """Drop rows whose max |entry| at any layer exceeds this times the layer's median row max; None = off."""
    warmup_rows: int = 4096
    """Rows used to estimate the sink medians and the entropy quantile threshold."""
    cka: str = "auto"
    """``exact`` (all fp64 cross moments), ``minibatch`` (HSIC1) or ``auto``: exact when P·d <= exact_max_width."""
    exact_max_width: int | None = None
    """Largest P·d for which ``auto`` keeps all cross moments ((P·d)² · 8 bytes per filter level, 2 n (P·d)²
    flops); None: 4096 on CPU, 20480 on CUDA (SmolLM2's 16,704 fits: 2.2 GB per level)."""
    cka_batch_size: int = 1024
    """Rows per HSIC1 minibatch (>= 4)."""
    cka_rows: int = 8192
    """Uniform reservoir sample of rows over the whole stream for minibatch CKA (and the exact re-rank)."""
    rerank_top: int = 20
    """Best subsets by closed-form H2(S) re-ranked by exact H1(S)."""
    rerank_rows: int = 4096
    """Uniform row subsample (reservoir) for exact H1(S) when cross moments are not kept."""
    one_per_block: bool = False
    """Require one layer per CKA depth block."""
    require_late_layer: bool = False
    """Require one layer at or beyond N-4."""
    min_layer_id: int = 1
    """Smallest allowed id (2 for SGLang's conditional +1 rule)."""
    min_tokens: int = 2048
    """Fewest rows that must survive the filters."""
    seed: int = 0
    """Seed of the minibatch shuffle and the reservoir."""

    @classmethod
    def merged(cls, options: "LayerAnalysisConfig | dict | None" = None, **fields) -> "LayerAnalysisConfig":
        """``options`` (a config, its dict, or None for the defaults) with ``fields`` set over it: how the
        ``LayerSelection`` callback combines its own arguments with its ``options``."""
        base = options if options is not None else cls()
        base = cls(**base) if isinstance(base, dict) else base
        return dataclasses.replace(base, **fields)

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.entropy_quantile is not None and self.entropy_threshold is not None:
            raise ValueError("give at most one of entropy_quantile and entropy_threshold")
        if self.entropy_quantile is not None and not 0.0 <= self.entropy_quantile < 1.0:
            raise ValueError(f"entropy_quantile must be in [0, 1), got {self.entropy_quantile}")
        if any(not 0.0 <= q < 1.0 for q in self.entropy_sweep):
            raise ValueError(f"entropy_sweep quantiles must be in [0, 1), got {self.entropy_sweep}")
        if self.entropy_key not in ("next", "self"):
            raise ValueError(f"entropy_key must be next or self, got {self.entropy_key!r}")
        if self.rows not in ("draft", "mask"):
            raise ValueError(f"rows must be draft or mask, got {self.rows!r}")
        if self.cka not in ("auto", "exact", "minibatch"):
            raise ValueError(f"cka must be auto, exact or minibatch, got {self.cka!r}")
        if self.cka_batch_size < 4:
            raise ValueError(f"cka_batch_size must be >= 4 (HSIC1), got {self.cka_batch_size}")
        if self.rerank_top < 1 or self.warmup_rows < 1 or self.rerank_rows < 4 or self.cka_rows < 4:
            raise ValueError("rerank_top and warmup_rows must be >= 1, rerank_rows and cka_rows >= 4")
        if self.skip_first < 0 or self.min_tokens < 1:
            raise ValueError("skip_first must be >= 0 and min_tokens >= 1")
        if self.sink_factor is not None and self.sink_factor <= 1:
            raise ValueError(f"sink_factor must be > 1 (or null to disable), got {self.sink_factor}")

    @property
    def entropy_filter_on(self) -> bool:
        return self.entropy_quantile is not None or self.entropy_threshold is not None

    def use_exact(self, num_candidates: int, dim: int, device: str | torch.device = "cpu") -> bool:
        """Whether all cross moments are kept for P candidates of width d on ``device``."""
        if self.cka == "auto":
            limit = self.exact_max_width
            if limit is None:
                limit = 20480 if torch.device(device).type == "cuda" else 4096
            return num_candidates * dim <= limit
        return self.cka == "exact"


@dataclass
class LayerStatistics:
    """What the collection produced.

    Attributes:
        layer_ids: the P candidate ids (HF ``hidden_states`` indices 1..N-1).
        num_layers: N.
        hidden_size: d.
        num_rows: n, rows analysed after every filter.
        h1: (P,) fp64 per-layer H1 (nats).
        h2: (P,) fp64 per-layer H2 (nats).
        cka: (P, P) fp64 linear CKA.
        cka_method: ``exact`` or ``minibatch``.
        counts: rows seen / removed per rule.
        entropy: the entropy filter's settings and the key distribution.
        sink_medians: (P,) median row max |entry| per layer from the warm-up, or None.
        moments: the fp64 accumulators.
        reservoir: (P, n_s, d) fp32 uniform row subsample for exact concatenation entropy, or None.
        cka_batches: number of HSIC1 minibatches (minibatch method).
        cka_rows: reservoir rows the minibatch CKA used (minibatch method).
        timings: seconds spent in the target forward, in the statistics, and in total.
        sweep: one :class:`LayerStatistics` (or ``{"quantile", "error"}``) per ``entropy_sweep`` quantile.
    """

    layer_ids: list[int]
    num_layers: int
    hidden_size: int
    num_rows: int
    h1: torch.Tensor
    h2: torch.Tensor
    cka: torch.Tensor
    cka_method: str
    counts: dict
    entropy: dict
    sink_medians: torch.Tensor | None
    moments: LayerMoments
    reservoir: torch.Tensor | None
    cka_batches: int = 0
    cka_rows: int = 0
    timings: dict = field(default_factory=dict)
    sweep: list = field(default_factory=list)

    def concat_entropies(self, idx: list[int]) -> tuple[float, float]:
        """Exact (H1, H2) of the concatenation of candidate positions ``idx``: cross moments if kept (all n
        rows, §5.2a), else the reservoir subsample (§5.2b)."""
        if self.moments.cross:
            return self.moments.concat_entropies(idx)
        return concat_entropies_from_rows(self.reservoir, idx)

    @property
    def concat_route(self) -> str:
        if self.moments.cross:
            return f"cross moments, n={self.num_rows}"
        return f"row subsample, n={0 if self.reservoir is None else self.reservoir.shape[1]}"


class _Level:
    """Per-layer moments of the rows kept at one entropy threshold (the primary filter or one sweep quantile)."""

    def __init__(self, quantile: float | None, threshold: float | None, num_candidates: int, dim: int,
                 exact: bool, device: torch.device) -> None:
        self.quantile, self.threshold = quantile, threshold
        self.moments = LayerMoments(num_candidates, dim, cross=exact, device=device)
        self.low_entropy = 0

    def keep(self, keys: torch.Tensor | None, n: int, device) -> torch.Tensor:
        """(n,) bool rows at or above the threshold."""
        if self.threshold is None or keys is None:
            return torch.ones(n, dtype=torch.bool, device=device)
        return keys >= self.threshold

    def fold(self, z: torch.Tensor, keys: torch.Tensor | None) -> None:
        """Add the rows at or above the threshold. z: (P, n, d) row-normalised; keys: (n,)."""
        keep = self.keep(keys, z.shape[1], z.device)
        self.low_entropy += int((~keep).sum())
        if bool(keep.any()):
            self.moments.update(z[:, keep] if not bool(keep.all()) else z)


class _Reservoir:
    """Uniform sample of ``capacity`` rows over the whole stream (Algorithm R, vectorised), with their keys."""

    def __init__(self, capacity: int, gen: torch.Generator) -> None:
        self.capacity, self.gen = capacity, gen
        self.rows: torch.Tensor | None = None  # (P, <= capacity, d)
        self.keys: torch.Tensor | None = None  # (<= capacity,)
        self.seen = 0

    def add(self, z: torch.Tensor, keys: torch.Tensor | None) -> None:
        p, n, d = z.shape
        keys = torch.zeros(n, device=z.device) if keys is None else keys
        if self.rows is None:
            self.rows = torch.empty(p, 0, d, dtype=torch.float32, device=z.device)
            self.keys = torch.empty(0, dtype=torch.float32, device=z.device)
        fill = min(max(self.capacity - self.rows.shape[1], 0), n)
        if fill:
            self.rows = torch.cat([self.rows, z[:, :fill]], 1)  # (P, <= capacity, d)
            self.keys = torch.cat([self.keys, keys[:fill]])
        seen = self.seen + fill
        if fill < n:
            g = torch.arange(seen, seen + n - fill, dtype=torch.float64)  # global index of each later row
            slot = torch.floor(torch.rand(n - fill, generator=self.gen, dtype=torch.float64) * (g + 1)).long()
            last: dict[int, int] = {}
            for j in torch.nonzero(slot < self.capacity).flatten().tolist():  # sequential semantics: later wins
                last[int(slot[j])] = j
            if last:
                slots = torch.tensor(list(last.keys()), dtype=torch.long, device=z.device)
                src = torch.tensor(list(last.values()), dtype=torch.long, device=z.device) + fill
                self.rows[:, slots] = z[:, src]
                self.keys[slots] = keys[src]
        self.seen = seen + (n - fill)


class LayerStatsCollector:
    """Filters rows and folds them into fp64 statistics; pure torch, no model.

    Besides the primary entropy filter of ``config``, each quantile in ``config.entropy_sweep`` gets its own
    statistics from the same rows (same sink filter, same warm-up), so one pass reports curves against the
    kept fraction (layer-analysis.md §7).

    Args:
        num_layers: N; candidates are ids 1..N-1.
        hidden_size: d.
        config: :class:`LayerAnalysisConfig`.
        device: where the statistics are computed.
    """

    def __init__(self, num_layers: int, hidden_size: int, config: LayerAnalysisConfig, device="cpu") -> None:
        self.config = config
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.layer_ids = list(range(1, num_layers))
        p = len(self.layer_ids)
        if p < 1:
            raise ValueError(f"a {num_layers}-layer target has no candidate layer (ids 1..N-1)")
        self.device = torch.device(device)
        self.exact = config.use_exact(p, hidden_size, self.device)
        specs = [(config.entropy_quantile, config.entropy_threshold)] + [(q, None) for q in config.entropy_sweep]
        self.levels = [_Level(q, t, p, hidden_size, self.exact, self.device) for q, t in specs]
        self.gen = torch.Generator().manual_seed(config.seed)
        self.reservoir = None if self.exact else _Reservoir(config.cka_rows, self.gen)
        self.counts = {"candidates": 0, "sink": 0}
        self.keys_seen: list[torch.Tensor] = []
        self.sink_medians: torch.Tensor | None = None
        self._warm = not (config.sink_factor is not None or any(q is not None for q, _ in specs))
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._pending_rows = 0

    @property
    def needs_keys(self) -> bool:
        """Whether :meth:`add` needs entropy keys."""
        return self.config.entropy_filter_on or bool(self.config.entropy_sweep)

    # -- intake -----------------------------------------------------------------------------------------
    def add(self, states: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """Add candidate rows.

        Args:
            states: (P, n, d) raw states of every candidate layer at the same n positions (any float dtype).
            keys: (n,) entropy keys in nats, required when an entropy filter or sweep is on.

        Raises:
            ValueError: on NaN/inf in a layer (naming its id), a shape mismatch, or missing keys.
        """
        p, n, d = states.shape
        if p != len(self.layer_ids) or d != self.hidden_size:
            raise ValueError(f"expected states (P={len(self.layer_ids)}, n, d={self.hidden_size}), got {tuple(states.shape)}")
        if n == 0:
            return
        if self.needs_keys and keys is None:
            raise ValueError("the entropy filter is on but no entropy keys were given")
        x = states.to(device=self.device, dtype=torch.float32)
        finite = torch.isfinite(x).flatten(1).all(1)  # (P,)
        if not bool(finite.all()):
            bad = [self.layer_ids[i] for i in torch.nonzero(~finite).flatten().tolist()]
            raise ValueError(
                f"target hidden states contain NaN or inf at layer ids {bad} (HF hidden_states indices); "
                "check the target weights and dtype (try target_dtype=float32)"
            )
        self.counts["candidates"] += n
        rowmax = x.abs().amax(-1)  # (P, n)
        z = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # (P, n, d), row-normalised
        del x
        if keys is not None:
            keys = keys.to(self.device, torch.float32)
            self.keys_seen.append(keys.cpu())
        if self._warm:
            self._filter_and_fold(z, rowmax, keys)
            return
        self._pending.append((z, rowmax, keys))
        self._pending_rows += n
        if self._pending_rows >= self.config.warmup_rows:
            self._end_warmup()

    def _end_warmup(self) -> None:
        if self._pending:
            rowmax = torch.cat([r for _, r, _ in self._pending], 1)  # (P, n_w)
            if self.config.sink_factor is not None:
                self.sink_medians = rowmax.median(1).values  # (P,)
            if self.needs_keys:
                keys = torch.cat([k for _, _, k in self._pending])  # (n_w,)
                for level in self.levels:
                    if level.quantile is not None:
                        level.threshold = quantile_threshold(keys, level.quantile)
        self._warm = True
        pending, self._pending, self._pending_rows = self._pending, [], 0
        for z, r, k in pending:
            self._filter_and_fold(z, r, k)

    def _filter_and_fold(self, z: torch.Tensor, rowmax: torch.Tensor, keys: torch.Tensor | None) -> None:
        if self.sink_medians is not None:
            sink = (rowmax > self.config.sink_factor * self.sink_medians[:, None]).any(0)  # (n,)
            if bool(sink.any()):
                self.counts["sink"] += int(sink.sum())
                z = z[:, ~sink]  # (P, n_kept, d)
                keys = None if keys is None else keys[~sink]
        for level in self.levels:
            level.fold(z, keys)
        if self.reservoir is not None:
            self.reservoir.add(z, keys)

    # -- output -----------------------------------------------------------------------------------------
    def _minibatch_cka(self, level: _Level) -> tuple[torch.Tensor, torch.Tensor, int]:
        """HSIC1 minibatch CKA over the level's rows of the reservoir, shuffled.

        Returns:
            (cka (P, P), rows for the exact re-rank (P, <= rerank_rows, d), minibatches, reservoir rows used).
        """
        cfg = self.config
        res = self.reservoir
        idx = torch.nonzero(level.keep(res.keys, res.rows.shape[1], res.rows.device)).flatten()
        idx = idx[torch.randperm(idx.numel(), generator=self.gen).to(idx.device)]
        rows = res.rows[:, idx]  # (P, n_s, d), shuffled
        mb = MinibatchCKA(len(self.layer_ids))
        nb = cfg.cka_batch_size
        for start in range(0, rows.shape[1], nb):
            chunk = rows[:, start:start + nb]
            # a short last minibatch counts only if it is at least half a batch (or the only one)
            if chunk.shape[1] >= 4 and (chunk.shape[1] * 2 >= nb or mb.num_batches == 0):
                mb.update(chunk)
        return mb.compute(), rows[:, : cfg.rerank_rows].clone(), mb.num_batches, rows.shape[1]

    def _level_stats(self, level: _Level, keys: torch.Tensor) -> LayerStatistics:
        cfg = self.config
        n = level.moments.n
        counts = {**self.counts, "low_entropy": level.low_entropy, "kept": n}
        if n < cfg.min_tokens:
            hint = []
            if level.threshold is not None:
                what = (
                    f"the entropy quantile (now {level.quantile}, threshold {level.threshold:.3f} nats)"
                    if level.quantile is not None else f"entropy_threshold (now {level.threshold} nats)"
                )
                hint.append(f"lower {what}")
            if self.counts["sink"]:
                hint.append(f"raise sink_factor (now {cfg.sink_factor})")
            if self.counts["candidates"] >= cfg.num_tokens:  # stopped at the cap: more of the data is left
                hint.append(f"raise num_tokens (now {cfg.num_tokens})")
            else:  # the data ran out first: num_tokens does not bind
                hint.append(f"give more data (all {self.counts['candidates']} candidate rows of it were read) or "
                            f"lower min_tokens (a smaller sample ranks the layers less reliably)")
            raise ValueError(
                f"only {n} rows are left after filtering ({counts}), fewer than min_tokens={cfg.min_tokens}; "
                + "; ".join(hint)
            )
        h1, h2 = level.moments.entropies()
        if self.exact:
            cka, subsample, batches, used = level.moments.cka(), None, 0, 0
        else:
            cka, subsample, batches, used = self._minibatch_cka(level)
        entropy = {
            "on": level.threshold is not None,
            "key": "H_{t+1}" if cfg.entropy_key == "next" else "H_t",
            "quantile": level.quantile,
            "threshold_nats": level.threshold,
            "kept_fraction": 1.0 - level.low_entropy / max(1, self.counts["candidates"] - self.counts["sink"]),
        }
        if keys.numel():
            qs = (0.1, 0.2, 0.5, 0.8, 0.9)
            vals = torch.quantile(keys[:1_000_000], torch.tensor(qs))
            entropy["key_mean_nats"] = float(keys.mean())
            entropy["key_quantiles_nats"] = {f"q{round(q * 100)}": float(v) for q, v in zip(qs, vals)}
        return LayerStatistics(
            layer_ids=self.layer_ids, num_layers=self.num_layers, hidden_size=self.hidden_size, num_rows=n,
            h1=h1.cpu(), h2=h2.cpu(), cka=cka.cpu(), cka_method="exact" if self.exact else "minibatch",
            counts=counts, entropy=entropy,
            sink_medians=None if self.sink_medians is None else self.sink_medians.cpu(),
            moments=level.moments, reservoir=subsample, cka_batches=batches,
            cka_rows=used,
        )

    def finalize(self) -> LayerStatistics:
        """Compute the statistics of the primary filter; sweep levels go to ``.sweep``.

        Raises:
            ValueError: when fewer than ``min_tokens`` rows survived the primary filter (with the counts and
                the option to change). A sweep level with too few rows is reported by its error instead.
        """
        if not self._warm:
            self._end_warmup()
        keys = torch.cat(self.keys_seen) if self.keys_seen else torch.empty(0)
        stats = self._level_stats(self.levels[0], keys)
        for level in self.levels[1:]:
            try:
                stats.sweep.append(self._level_stats(level, keys))
            except ValueError as exc:
                stats.sweep.append({"quantile": level.quantile, "error": str(exc)})
        return stats


def _row_mask(batch: dict, config: LayerAnalysisConfig, exclude_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) bool rows to analyse, and (B, T) int64 positions of their entropy key (-1 if none)."""
    ids, attn, lm = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool() & batch["attention_mask"].bool()
    b, t = ids.shape
    pos = batch["attention_mask"].long().cumsum(1) - 1  # (B, T), handles left padding
    rows = torch.zeros_like(attn)
    if config.rows == "draft":
        rows[:, : t - 2] = lm[:, 2:]  # row p supervised at step 0 iff m_{p+2} = 1 (and p + 2 real)
    else:
        rows[:, : t - 1] = lm[:, : t - 1] & attn[:, 1:]  # m_p = 1 with a next position
    rows &= attn & (pos >= config.skip_first)
    if exclude_ids.numel():
        rows &= ~torch.isin(ids, exclude_ids.to(ids.device))
    offset = 1 if config.entropy_key == "next" else 0
    key_pos = torch.arange(t, device=ids.device).expand(b, t) + offset  # (B, T)
    return rows, key_pos


@torch.no_grad()
def collect_layer_statistics(
    model: torch.nn.Module,
    batches,
    config: LayerAnalysisConfig,
    exclude_token_ids: list[int] | tuple[int, ...] = (),
    device: str | torch.device | None = None,
    entropy_chunk: int = 512,
    log_every_s: float = 30.0,
) -> LayerStatistics:
    """Run the target over batches and compute the per-layer entropies and the CKA matrix.

    Args:
        model: a Hugging Face Llama-style ``*ForCausalLM`` in eval mode (any dtype); left unchanged (the hooks
            are removed afterwards).
        batches: iterable of dicts with ``input_ids`` (B, T) int64, ``attention_mask`` (B, T) 0/1 and
            ``loss_mask`` (B, T) 0/1 (1 = assistant token).
        config: :class:`LayerAnalysisConfig`.
        exclude_token_ids: ids whose rows are dropped (BOS; padding is excluded by ``attention_mask``, since a
            pad id may equal the end-of-turn id, as in SmolLM2).
        device: where the target runs (default: its parameters' device).
        entropy_chunk: positions per log_softmax chunk for the entropy keys.
        log_every_s: seconds between progress lines.

    Returns:
        :class:`LayerStatistics`.

    Raises:
        ValueError: on NaN/inf states (naming the layer), a batch without the three keys, or too few rows
            after filtering.
    """
    t0 = time.perf_counter()
    device = torch.device(device) if device is not None else next(model.parameters()).device
    cfg_model = text_config(model.config)
    num_layers, hidden = cfg_model.num_hidden_layers, cfg_model.hidden_size
    base = getattr(model, "model", model)
    lm_head = model.get_output_embeddings()
    collector = LayerStatsCollector(num_layers, hidden, config, device)
    layer_ids = collector.layer_ids
    exclude = torch.tensor(sorted({int(i) for i in exclude_token_ids}), dtype=torch.long)
    need_keys = collector.needs_keys
    scanned, sequences, t_forward, cpu_forward, tokens, last_log = 0, 0, 0.0, 0.0, 0, time.perf_counter()
    with capture_hidden_states(model, layer_ids) as captured:
        for batch in batches:
            missing = {"input_ids", "attention_mask", "loss_mask"} - set(batch)
            if missing:
                raise ValueError(f"layer analysis batches need input_ids, attention_mask and loss_mask; missing {sorted(missing)}")
            batch = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "loss_mask")}
            rows, key_pos = _row_mask(batch, config, exclude)
            budget = config.num_tokens - scanned
            bi, ti = torch.nonzero(rows, as_tuple=True)  # row-major
            bi, ti = bi[:budget], ti[:budget]
            if bi.numel() == 0:
                continue
            tf, cf = time.perf_counter(), time.process_time()
            out = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
            t_forward += time.perf_counter() - tf
            cpu_forward += time.process_time() - cf
            tokens += int(batch["attention_mask"].sum())
            states = torch.stack([captured[i][bi, ti] for i in layer_ids], 0)  # (P, n, d)
            keys = None
            if need_keys:
                hk = out.last_hidden_state[bi, key_pos[bi, ti]]  # (n, d), normed final state at the key position
                keys = torch.cat([
                    token_entropy(target_logits(lm_head, hk[s:s + entropy_chunk], model.config), entropy_chunk)
                    for s in range(0, hk.shape[0], entropy_chunk)
                ])  # (n,)
            captured.clear()
            del out
            collector.add(states, keys)
            scanned += bi.numel()
            sequences += int(rows.any(1).sum())
            if time.perf_counter() - last_log > log_every_s:
                last_log = time.perf_counter()
                el = last_log - t0
                log.info("layer analysis: %d/%d rows scanned (%d tokens forwarded) in %.0f s (%.0f rows/s)",
                         scanned, config.num_tokens, tokens, el, scanned / el)
            if scanned >= config.num_tokens:
                break
    t_collect = time.perf_counter() - t0
    if scanned == 0:
        raise ValueError("the data yielded no row to analyse (no assistant token after the position rules): a "
                         "sequence cut at the max length before its first answer has none; raise --max_length "
                         "(data.max_length), or give data with assistant turns")
    stats = collector.finalize()
    stats.counts["sequences"] = sequences
    stats.timings = {
        "forward_tokens": tokens,
        "forward_s": round(t_forward, 2),
        "forward_cpu_s": round(cpu_forward, 2),
        "statistics_s": round(time.perf_counter() - t0 - t_forward, 2),
        "collect_total_s": round(time.perf_counter() - t0, 2),
        "scan_s": round(t_collect, 2),
    }
    if not math.isfinite(float(stats.h1.sum())):
        raise ValueError("per-layer entropies are not finite; analyse more tokens")
    return stats
