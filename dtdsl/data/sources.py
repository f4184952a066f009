"""A spec's ``data.source``, whatever its format: which reader opens it, and whether it can.

- a directory holding a dtdsl dataset (its ``index.json``, as ``dtc data synth`` writes it):
  ``shards.Dataset``;
- a ``.json`` or ``.jsonl`` file: LLaVA-style conversations with an image folder
  (``llava``; the spec's ``image_folder``, by default the file's folder);
- anything else: WebDataset tar shards (``webdataset``: a directory of ``*.tar``, a brace
  pattern, a ``.tar``, or a list of them).

``open_dataset`` opens one for reading (a WebDataset is indexed on first use);
``source_problem`` says, cheaply, why one cannot be read (nothing indexed): the check of
a launch's preflight and of ``--data``. ``data_diagnostics`` is ``dtc check``'s and
``dtc compile``'s: what ``source_problem`` finds (DT314), then the source opened (indexed
once) and its samples counted as a run counts them: nothing to train on is DT317,
samples left out or outside the spec's clamps (``data.clamps``) the warning DT505, an
encoder or generator whose modality no sample carries DT506.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dtdsl.codes import DT314, DT315, DT317, DT505, DT506
from dtdsl.data.paths import Refused, open_regular
from dtdsl.data.shards import FORMAT, INDEX_NAME, Dataset, DatasetError, NoSamples
from dtdsl.ir import program as ir

__all__ = ["data_diagnostics", "image_role", "is_dtdsl_dataset", "is_synthetic",
           "open_dataset", "source_problem"]


def _single(source: str | Path | Sequence[str | Path]) -> str | None:
    if isinstance(source, (str, Path)):
        return str(source)
    return str(source[0]) if len(source) == 1 else None


def is_dtdsl_dataset(path: str | Path) -> bool:
    """Whether ``path`` is a directory with a dtdsl dataset index."""
    index = Path(path) / INDEX_NAME
    if not index.is_file():
        return False
    try:
        with open(index, "rb") as f:
            head = f.read(4096)
        return f'"format": "{FORMAT}"'.encode() in head or \
            json.loads(index.read_bytes()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def image_role(program: ir.Program | None) -> str:
    """Whether a WebDataset sample's images are encoder inputs or generation targets: the
    targets of a model with an image generator and no image encoder (text-to-image)."""
    if program is None:
        return "input"
    reads = any(m.modality == "image" for m in program.encoders)
    makes = any(m.modality == "image" for m in program.generators)
    return "target" if makes and not reads else "input"


def _resolve(source: str | Sequence[str], base_dir: Path) -> Path | None:
    one = _single(source)
    if one is None or "{" in one:
        return None
    path = Path(one).expanduser()
    return path if path.is_absolute() else base_dir / path


def open_dataset(source: str | Sequence[str], *, base_dir: str | Path = ".",
                 program: ir.Program | None = None, cache_dir: str | Path | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 rebuild: bool = False, image_folder: str | Path | None = None) -> Any:
    """The dataset ``source`` names (module docstring), opened: a ``shards.Dataset``, a
    ``llava.LlavaDataset`` or a ``webdataset.WebDataset`` (indexed now if it has no index
    yet, or ``rebuild``). DatasetError when it cannot be read."""
    from dtdsl.data.llava import LlavaDataset, is_llava_source
    from dtdsl.data.webdataset import WebDataset, build_index, resolve_shards

    base = Path(base_dir)
    path = _resolve(source, base)
    if path is not None and path.is_dir() and is_dtdsl_dataset(path):
        return Dataset.open(path)
    if path is not None and is_llava_source(path):
        folder = image_folder if image_folder is not None else (
            program.data.image_folder if program is not None else None)
        return LlavaDataset.open(path, folder, cache_dir=cache_dir, progress=progress)
    refused: dict[str, str] = {}
    shards = resolve_shards(source, base, refused)
    return WebDataset(build_index(shards, cache_dir=cache_dir, progress=progress,
                                  rebuild=rebuild), image_role=image_role(program),
                      refused=refused)


def is_synthetic(source: str | Sequence[str], base_dir: str | Path = ".") -> bool:
    """Whether ``source`` is a dataset ``dtc data synth`` wrote (text of a made-up language,
    which the hashing tokenizer reads)."""
    path = _resolve(source, Path(base_dir))
    return path is not None and path.is_dir() and is_dtdsl_dataset(path)


def source_problem(source: str | Sequence[str], base_dir: str | Path = ".") -> str | None:
    """Why ``source`` cannot be read, or None: it names no file, a dtdsl dataset whose
    index is missing or corrupt, an empty folder, or a first shard that is not a tar, or
    a path the system refuses (a name too long). Reads the index or the first shard's
    first header, nothing more."""
    try:
        return _source_problem(source, base_dir)
    except OSError as err:
        return f"cannot read {source}: {err.strerror or err}"


def _source_problem(source: str | Sequence[str], base_dir: str | Path) -> str | None:
    from dtdsl.data.llava import is_llava_source
    from dtdsl.data.webdataset import COMPRESSED_HEAD, compressed_problem, resolve_shards

    base = Path(base_dir)
    path = _resolve(source, base)
    if path is not None and is_llava_source(path):
        return _json_problem(path)
    try:
        if path is not None and path.is_dir() and is_dtdsl_dataset(path):
            with Dataset.open(path):
                return None
        if path is not None and path.is_dir() and not any(path.glob("*.tar")):
            entries = sorted(p.name for p in path.iterdir())[:3]
            return (f"{path} holds no dataset: no dtdsl index and no .tar shards" +
                    (f" (it has {', '.join(entries)})" if entries else " (it is empty)"))
        shards = resolve_shards(source, base)
    except DatasetError as err:
        return str(err)
    try:
        with open_regular(shards[0]) as f:
            why = compressed_problem(shards[0], f.read(COMPRESSED_HEAD))
            if why is not None:
                return why
            f.seek(0)
            with tarfile.open(fileobj=f, mode="r:") as tar:
                if tar.next() is None:
                    return f"{shards[0]} is an empty tar"
    except Refused as err:
        return str(err)
    except (tarfile.TarError, OSError, EOFError) as err:
        return f"{shards[0]} is not a readable tar: {err}"
    return None


def _json_problem(path: Path) -> str | None:
    """Why a LLaVA-style JSON cannot be read (its first bytes only), or None."""
    from dtdsl.data.llava import BOM

    try:
        with open_regular(path) as f:
            head = f.read(4096).removeprefix(BOM).lstrip()
    except Refused as err:
        return str(err)
    except OSError as err:
        return f"cannot read {path}: {err.strerror or err}"
    if not head:
        return f"{path} is empty"
    if path.suffix == ".json" and not head.startswith(b"["):
        return f"{path} is not a JSON array of records (LLaVA's format)"
    if path.suffix == ".jsonl" and not head.startswith(b"{"):
        return f"{path} does not start with a JSON record"
    return None


def data_diagnostics(program: ir.Program, base_dir: str | Path) -> list[Any]:
    """What ``dtc check`` and ``dtc compile`` say of the spec's ``source`` (paths relative
    to ``base_dir``, the spec's folder): DT314 when it cannot be read, DT315 for real text
    without a tokenizer, DT317 when no sample is left to train on, DT505 for samples left
    out or outside the spec's clamps (module docstring)."""
    from dtdsl.diagnostics import Diagnostic

    source = program.data.source
    if source is None:
        return []
    span = program.data.source_span or program.data.span
    problem = source_problem(source, base_dir)
    if problem is not None:
        return [_nothing_left(source, problem, span) if _all_refused(source, base_dir)
                else Diagnostic.error(
            DT314, f"data source {source!r} cannot be read: {problem}", span,
            notes=["paths are relative to the spec's folder"],
            hint="point source at a dataset (`dtc data synth` writes one) or at WebDataset "
            "shards; to check or compile without data, pass --synthetic (samples drawn from "
            "the spec's distributions)")]
    if program.data.tokenizer is None and not is_synthetic(source, base_dir):
        return [Diagnostic.error(
            DT315, f"data source {source!r} is real text, which needs a tokenizer", span,
            notes=["the hashing tokenizer is only for synthetic data (`dtc data synth`)"],
            hint='add `tokenizer = "PATH"` to the data block (a tokenizer.json or a '
            "Hugging Face folder), or give the backbone `pretrained` weights whose "
            "folder has one")]
    return _survey(program, source, base_dir, span)


def _all_refused(source: str | Sequence[str], base_dir: str | Path) -> bool:
    from dtdsl.data.webdataset import resolve_shards

    try:
        resolve_shards(source, base_dir)
    except NoSamples:
        return True
    except (DatasetError, OSError):
        return False
    return False


def _nothing_left(source: Any, why: str, span: Any) -> Any:
    from dtdsl.diagnostics import Diagnostic

    return Diagnostic.error(
        DT317, f"data source {source!r} has no sample to train on: {why}", span,
        notes=["dtdsl reads only files inside their folder (no `..`, no absolute paths, no "
               "symlink out of it) that are regular files (no FIFO or device)"],
        hint="fix the data or where its paths start (`image_folder` for a LLaVA JSON); "
        "`dtc data index SOURCE` shows what is read and what is left out")


def _survey(program: ir.Program, source: str, base_dir: str | Path, span: Any) -> list[Any]:
    """DT317 and DT505 from the source's samples, counted as a run counts them: its index
    (built once) and its text's layouts under the spec's tokenizer. Whether each image
    decodes is the run's own check (``data.usable``): it reads every pixel."""
    from dtdsl.data.decode import Decoder
    from dtdsl.data.text import TokenizerError, token_layouts
    from dtdsl.data.usable import NO_LAYOUT, left_out_text
    from dtdsl.diagnostics import Diagnostic

    try:
        decoder = Decoder.for_program(program, seed=program.train.seed)
    except (TokenizerError, ValueError):
        return []           # the front end reports an unusable tokenizer or modality
    try:
        dataset = open_dataset(source, base_dir=base_dir, program=program)
    except NoSamples as err:
        return [_nothing_left(source, str(err), span)]
    except DatasetError as err:
        return [Diagnostic.error(DT314, f"data source {source!r} cannot be read: {err}",
                                 span, notes=["paths are relative to the spec's folder"])]
    with dataset:
        try:
            layouts = token_layouts(dataset, decoder.tokenizer, kinds=decoder.kinds)
        except DatasetError as err:
            return [Diagnostic.error(DT314, f"data source {source!r} cannot be read: {err}",
                                     span)]
        laid = [i for i, lay in enumerate(layouts) if lay is not None]
        told = left_out_text(dataset, {NO_LAYOUT: len(layouts) - len(laid)})
        if not laid:
            why = (f"its index holds {len(layouts)} samples; {told}" if told
                   else "it holds no samples")
            return [_nothing_left(source, why, span)]
        out = []
        if told:
            out.append(Diagnostic.warning(
                DT505, f"data source {source!r}: {len(laid)} of its {len(layouts)} indexed "
                f"samples can be trained on; {told}", span,
                hint="`dtc data index SOURCE` lists what is left out and why"))
        out += _clamp_warnings(program, source, dataset, decoder, layouts, laid)
        out += _idle_modules(program, source, dataset, laid)
    return out


def _idle_modules(program: ir.Program, source: str, dataset: Any,
                  laid: Sequence[int]) -> list[Any]:
    """DT506 per encoder (generator) whose modality none of the trainable samples carries
    as an input (a target): it would train on nothing, priced on the data block's
    distributions all the same."""
    from dtdsl.diagnostics import Diagnostic

    infos = [dataset.info(i) for i in laid]
    carried = {
        ("encoder", "image"): any(x.images for x in infos),
        ("encoder", "audio"): any(x.audio_count for x in infos),
        ("encoder", "video"): any(x.videos for x in infos),
        ("generator", "image"): any(x.gen_images for x in infos),
        ("generator", "audio"): any(x.gen_audio_count for x in infos),
    }
    out = []
    for module in (*program.encoders, *program.generators):
        if carried.get((module.role, module.modality), True):
            continue
        what = f"{module.modality} " + ("input" if module.role == "encoder" else
                                         "generation target")
        article = "an" if what[0] in "aeiou" else "a"
        out.append(Diagnostic.warning(
            DT506, f"data source {source!r}: none of its {len(infos)} samples carries "
            f"{article} {what}: {module.role} {module.name} would train on nothing",
            module.span,
            notes=["the plan prices the data block's distributions, not what the source "
                   "holds"],
            hint=f"train on data with {what}s (`dtc data stats {source}` "
            f"counts them), or remove {module.name} from the model"))
    return out


def _clamp_warnings(program: ir.Program, source: str, dataset: Any, decoder: Any,
                    layouts: Sequence[Any], laid: Sequence[int]) -> list[Any]:
    """DT505 per clamp of the data block that samples lie outside of (``data.clamps``)."""
    from dtdsl.data.clamps import Clamps, Outside, what_happens
    from dtdsl.data.images import patch_grid
    from dtdsl.diagnostics import Diagnostic

    clamps = Clamps.for_program(program)
    gen_of = {g.name: g.modality for g in program.generators}
    samples = []
    patches = 0
    policy = decoder.images
    high = policy.max_patches if policy is not None and policy.size is None else None
    for i in laid:
        info = dataset.info(i)
        gen = {g: len(info.gen_images) if m == "image" else info.gen_audio_count
               for g, m in gen_of.items()}
        samples.append((layouts[i][0], len(info.images), gen))
        if high is not None:
            patches += sum(1 for w, h in info.images
                           if _area(patch_grid(w, h, policy.patch)) > high)
    outside = clamps.count(samples)
    if patches:
        q = program.data.get("image", "patches")
        low = int(q.low) if q is not None and q.low is not None else None
        outside.append(Outside(key="image.patches", low=low, high=high, above=patches))
    out = []
    for o in outside:
        modality, name = o.key.split(".")
        quantity = program.data.get(modality, name)
        where = quantity.span if quantity is not None else program.data.span
        bounds = f"clamp [{_num(o.low)}, {_num(o.high)}]"
        what = "images" if o.key == "image.patches" else "samples"
        if o.above:
            out.append(Diagnostic.warning(
                DT505, f"data source {source!r}: {o.above} of {len(samples)} {what} are "
                f"above the {bounds} of {o.key}: {what_happens(o)}", where,
                hint=f"widen the clamp to the data (`dtc data stats {source} --spec SPEC`), "
                "or keep it to train on the data cut to it"))
        if o.below:
            out.append(Diagnostic.warning(
                DT505, f"data source {source!r}: {o.below} of {len(samples)} samples are "
                f"below the {bounds} of {o.key}: they are used as they are (nothing is "
                "padded)",
                where, hint="lower the clamp's low to what the data holds"))
    return out


def _area(grid: tuple[int, int]) -> int:
    return grid[0] * grid[1]


def _num(x: int | None) -> str:
    return "-" if x is None else str(x)
