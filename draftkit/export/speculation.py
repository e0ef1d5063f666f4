"""The speculation shape an export is launched with: a chain of k drafts, or an EAGLE-2 tree (depth, top-k, N).

The shape is given by hand (``draftkit export --tree 5,4,16``) or read from a ``draftkit evaluate`` report
(``--from_report``): the cost model's choice when the report has an ``auto`` block (``evaluate --k auto`` /
``--tree auto``), else the configuration the report measured (its ``tree`` block, or its chain ``k``). A report
whose shape is a hybrid with prompt lookup (``decoding.tree.TreeConfig.lookup``) gives the engines its head's
shape, and the sidecar's ``speculation.hybrid`` says which engines run the lookup branch too (llama.cpp's
``--spec-type draft-eagle3,ngram-mod``; vLLM, SGLang and TensorRT-LLM not yet). Each engine module turns the shape
into its own settings (``speculation_settings``):

- SGLang launch flags: chain k = num-steps k, eagle-topk 1, num-draft-tokens k + 1; tree D,K,N = num-steps D,
  eagle-topk K, num-draft-tokens N + 1 (the root counted);
- TensorRT-LLM ``trtllm_spec.yaml``: chain k = ``max_draft_len: k``; tree = ``max_draft_len: D``,
  ``use_dynamic_tree: true``, ``dynamic_tree_max_topK: K``, ``max_total_draft_tokens: N``;
- vLLM (and speculators): ``num_speculative_tokens`` k; a tree is served as the chain of its depth D (vLLM
  drafts chains only), which the sidecar notes.

A report's choice was made for the machine the report ran on (draftkit's own decoding, usually a CPU); the
sidecar records that machine next to the shape, because a serving GPU's costs differ.

Shapes: D depth (draft tokens on the longest path), K top-k, N verified draft nodes (root excluded).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from draftkit.decoding.tree import TreeConfig
from draftkit.export.common import portable_path

log = logging.getLogger(__name__)

__all__ = ["REPORT_OPTION", "TREE_OPTION", "Speculation", "chain_only_note", "resolve_speculation"]

TREE_OPTION = "--tree"
"""The ``draftkit export`` option of a hand-given tree (named in errors)."""
REPORT_OPTION = "--from_report"
"""The ``draftkit export`` option of an evaluate report (named in errors)."""


@dataclass(frozen=True)
class Speculation:
    """A speculation shape and where it came from.

    Attributes:
        tree: the topology; a chain of k drafts is ``TreeConfig.chain(k)`` (top-k 1, N = k).
        source: ``"--tree"`` or ``"--from_report"`` (the option that gave it).
        report: for a shape read from a report, its provenance (:meth:`from_report`; the report named by its
            :func:`~draftkit.export.common.portable_path`, as the sidecar records it); else None.
        report_file: the report's path as given (for messages; never written).

    Raises:
        ValueError: for a top-k 1 tree whose N differs from its depth (a top-k 1 tree is a chain of N drafts;
            engines take chains as steps = drafts).
    """

    tree: TreeConfig
    source: str = TREE_OPTION
    report: dict | None = None
    report_file: str | None = None

    def __post_init__(self) -> None:
        if self.tree.topk == 1 and not self.tree.is_chain:
            raise ValueError(
                f"{self.source}: a top-k 1 tree is a chain of N drafts; give N equal to the depth, got {self.tree} "
                f"(for a chain of {self.tree.num_nodes}, use --num_speculative_tokens {self.tree.num_nodes})"
            )

    @property
    def k(self) -> int:
        """Draft tokens on the longest path (the chain's k, the tree's depth D)."""
        return self.tree.depth

    @property
    def is_chain(self) -> bool:
        return self.tree.is_chain

    @classmethod
    def parse(cls, text: str) -> "Speculation":
        """The hand-given tree ``"D,K,N"`` of ``--tree`` (e.g. ``"5,4,16"``; ``"3,1,3"`` is the chain k = 3).

        Raises:
            ValueError: naming ``--tree`` when the text is not three integers or the tree is invalid.
        """
        return cls(TreeConfig.parse(text, TREE_OPTION, auto=False), TREE_OPTION)

    @classmethod
    def from_report(cls, path: str | Path) -> "Speculation":
        """The shape of a ``draftkit evaluate`` report (``decoding.harness`` keys).

        With an ``auto`` block the cost model's choice is taken (``choice`` ``"chain k=3"`` or ``"D,K,N"``; the
        report's ``tree``/``k`` hold the same shape and must agree). Without it the measured configuration is
        taken: the ``tree`` block ``{"depth", "topk", "num_nodes"}`` when present, else the chain ``k``.

        Args:
            path: the report JSON file.

        Returns:
            The shape, with ``report`` = {path, chosen_by, choice, predicted_speedup (auto only),
            measured_speedup, tau, device, hardware, cpu_capability, target_dtype, dataset, checkpoint,
            head_fingerprint (the head it measured; None in reports older than the field), num_prompts,
            temperature}.

        Raises:
            FileNotFoundError: if the file does not exist.
            ValueError: naming ``--from_report`` and the file when it is not a JSON object, holds no shape, holds
                an invalid or inconsistent one, or the cost model chose plain decoding (nothing to speculate).
        """
        path = Path(path).expanduser()
        where = f"{REPORT_OPTION} {path}"
        if not path.is_file():
            raise FileNotFoundError(f"{where}: no such report file (write one with `draftkit evaluate --output`)")
        try:
            report = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{where}: not a JSON evaluate report ({exc})") from exc
        if not isinstance(report, dict):
            raise ValueError(f"{where}: not an evaluate report (a JSON object), got {type(report).__name__}")
        auto = report.get("auto") if isinstance(report.get("auto"), dict) else None
        setup = report.get("setup") if isinstance(report.get("setup"), dict) else {}
        if auto is not None and auto.get("choice") == "plain":
            raise ValueError(
                f"{where}: the cost model chose plain decoding on {setup.get('hardware', 'its machine')} (no chain or "
                "tree was predicted faster), so the report has no speculation shape to export; give --tree or "
                "--num_speculative_tokens"
            )
        tree = _report_tree(report, where)
        hybrid = report.get("hybrid") if isinstance(report.get("hybrid"), dict) else None
        if auto is not None:
            expected = f"chain k={tree.depth}" if tree.is_chain else str(tree)
            if hybrid is not None:
                expected += f"+{hybrid.get('mode')}={hybrid.get('lookup_tokens')}"
            if auto.get("choice") != expected:
                raise ValueError(f"{where}: auto.choice {auto.get('choice')!r} disagrees with the report's shape "
                                 f"{expected!r}; the report was edited or is damaged")
        precision = setup.get("precision") if isinstance(setup.get("precision"), dict) else {}
        capability = (precision.get("auto") or {}).get("reason") if isinstance(precision.get("auto"), dict) else None
        provenance = {
            "path": portable_path(path),  # no machine path in an export (as the sidecar names its sources)
            "chosen_by": "cost model (evaluate --k auto / --tree auto)" if auto is not None
            else "measured configuration (evaluate --k / --tree)",
            "choice": auto.get("choice") if auto is not None else None,
            "predicted_speedup": auto.get("predicted_speedup") if auto is not None else None,
            "measured_speedup": auto.get("measured_speedup") if auto is not None else report.get("speedup"),
            "tau": report.get("tau"),
            "device": setup.get("device"),
            "hardware": setup.get("hardware"),
            "cpu_capability": capability,
            "target_dtype": setup.get("target_dtype"),
            "dataset": setup.get("dataset"),
            "checkpoint": portable_path(setup["checkpoint"]) if setup.get("checkpoint") else None,
            "head_fingerprint": setup.get("head_fingerprint"),
            "num_prompts": report.get("num_prompts"),
            "temperature": report.get("temperature"),
            **({"hybrid": hybrid} if hybrid is not None else {}),
        }
        return cls(tree, REPORT_OPTION, provenance, str(path))

    def check_head(self, checkpoint: str | Path, state: dict) -> None:
        """Refuse a report's shape for a head the report did not measure: the shape the cost model picked (or the
        one measured) is that head's, its speedup and τ too. Hand-given shapes and reports older than the
        ``head_fingerprint`` field (logged) pass.

        Args:
            checkpoint: what is exported (named in the message).
            state: its head tensors (``HeadSource.state``), fingerprinted with
                :func:`draftkit.heads.checkpoint.head_fingerprint` as ``evaluate`` fingerprints the head it loads.

        Raises:
            ValueError: naming ``--from_report``, both heads and what to do, when the fingerprints differ.
        """
        from draftkit.heads.checkpoint import head_fingerprint

        if self.report is None:
            return
        measured = self.report.get("head_fingerprint")
        where = f"{REPORT_OPTION} {self.report_file or self.report['path']}"
        if measured is None:
            log.warning("%s names no head fingerprint (written before evaluate recorded one): not checked that it "
                        "measured %s", where, checkpoint)
            return
        exported = head_fingerprint(state)
        if exported != measured:
            raise ValueError(
                f"{where} measured another head ({self.report.get('checkpoint')}, weights {measured}) than the one "
                f"exported ({checkpoint}, weights {exported}); its shape, τ and speedup are that head's: run "
                f"`draftkit evaluate --checkpoint {checkpoint} --k auto --output REPORT.json` and export with "
                "--from_report REPORT.json, or give the shape with --tree / --num_speculative_tokens"
            )

    def record(self, engine_settings: dict | None = None) -> dict:
        """The sidecar's ``speculation`` entry: the shape, the option that gave it, what the engine was given,
        and the report's provenance (None for a hand-given shape)."""
        hybrid = (self.report or {}).get("hybrid")
        return {
            "topology": "chain" if self.is_chain else "tree",
            # the report's shape was a hybrid with prompt lookup: the engine gets the head's shape; which engines
            # run the lookup branch too (llama.cpp) is in ``hybrid.engines``
            **({"hybrid": hybrid} if hybrid else {}),
            "depth": self.tree.depth,
            "topk": self.tree.topk,
            "num_nodes": self.tree.num_nodes,
            "source": self.source,
            "engine_settings": engine_settings,
            "report": self.report,
            "note": None if self.report is None else (
                "chosen for the machine the report ran on (device, hardware, cpu_capability); a serving GPU's "
                "costs differ, so re-tune there when its speed matters"),
        }


def _report_tree(report: dict, where: str) -> TreeConfig:
    """The report's ``tree`` block, else its chain ``k`` (see :meth:`Speculation.from_report`)."""
    block = report.get("tree")
    try:
        if isinstance(block, dict):
            return TreeConfig(int(block["depth"]), int(block["topk"]), int(block["num_nodes"]))
        k = report.get("k")
        if block is None and isinstance(k, int) and not isinstance(k, bool):
            return TreeConfig.chain(k)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: invalid speculation shape in the report ({exc!r})") from exc
    raise ValueError(f"{where}: the report has no speculation shape: expected a `draftkit evaluate` report with an "
                     f"`auto` choice, a `tree` block {{depth, topk, num_nodes}} or a chain `k` (got tree={block!r}, "
                     f"k={report.get('k')!r})")


def resolve_speculation(
    num_speculative_tokens: int | None, tree: str | None = None, from_report: str | Path | None = None
) -> tuple[int, Speculation | None]:
    """k and the shape of ``draftkit export``'s three speculation options (at most one may be given).

    Args:
        num_speculative_tokens: a chain's k (``-k``); None = 3 when no other option is given.
        tree: ``"D,K,N"`` (:meth:`Speculation.parse`).
        from_report: an evaluate report (:meth:`Speculation.from_report`).

    Returns:
        (k, shape): k = 3 / the given k / the shape's depth; shape None unless ``tree`` or ``from_report``.

    Raises:
        ValueError: when two of the options are given, or as :meth:`Speculation.parse` / ``from_report``.
        FileNotFoundError: as :meth:`Speculation.from_report`.
    """
    given = [name for name, value in (("--num_speculative_tokens", num_speculative_tokens), (TREE_OPTION, tree),
                                      (REPORT_OPTION, from_report)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one speculation shape, not {' and '.join(given)} together")
    if tree is not None:
        shape = Speculation.parse(tree)
    elif from_report is not None:
        shape = Speculation.from_report(from_report)
    else:
        return (3 if num_speculative_tokens is None else num_speculative_tokens), None
    return shape.k, shape


def chain_only_note(tree: TreeConfig | None) -> str | None:
    """What a chain-only engine (vLLM, speculators) does with a tree: it drafts a chain of the tree's depth.

    vLLM's EAGLE3 proposer has no EAGLE-2 dynamic tree (its experimental ``speculative_token_tree`` is a fixed
    shape with its own attention backend, not this rule), so the export launches the chain of depth D.

    Returns:
        The note for the sidecar, or None for a chain (nothing is lost).
    """
    if tree is None or tree.is_chain:
        return None
    return (f"vLLM drafts chains only: tree {tree} (depth {tree.depth}, top-k {tree.topk}, N {tree.num_nodes}) is "
            f"served as a chain of its depth, num_speculative_tokens {tree.depth}; its top-k and N are not used")
