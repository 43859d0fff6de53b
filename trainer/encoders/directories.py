"""Which directories a run's VAE, text encoder and tokenizer come from (torch-free, so the login
node checks them).

A diffusers pipeline directory (model_index.json beside transformer/, vae/, text_encoder/,
tokenizer/ and scheduler/, as Wan-AI's "-Diffusers" releases ship) given as
`pretrained_transformer_path` supplies defaults for every key the user did not set:

    vae_path               <dir>/vae                 (when validation decodes or vae/ is there)
    text_encoder           <dir>/text_encoder        (its tokenizer read from <dir>/tokenizer)
    text_max_tokens,       the model family's own pipeline's (ModelFamily.pipeline_defaults;
    validation_steps,      Wan: 512, WanPipeline's max_sequence_length, captions padded to it
    validation_guidance    with zero vectors; 50 steps at guidance 5.0)
    train_timestep_shift   scheduler/scheduler_config.json's flow_shift (or shift)
    train_timestep_range   for an expert folder of a Wan2.2 A14B directory (model_index.json
                           with transformer_2 and boundary_ratio b), the timesteps WanPipeline
                           gives that expert: transformer/ [b, 1], transformer_2/ [0, b]
                           (stages that draw flow matching's noise levels)

A value the YAML or the command line sets always wins. A folder that is missing is still
named, so preflight refuses the run with one paragraph (`missing_component`) rather than
training on the stand-in encoder or the identity VAE.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


# Each entry is one way a transformers tokenizer can be stored: every file of it must be there.
TOKENIZER_FILE_SETS = (
    ("tokenizer.json",),                # a `tokenizers` serialization (fast tokenizers)
    ("spiece.model",),                  # sentencepiece (T5, UMT5)
    ("tokenizer.model",),               # sentencepiece (Llama-style)
    ("sentencepiece.bpe.model",),       # sentencepiece (XLM-R-style)
    ("vocab.json", "merges.txt"),       # byte-level BPE (GPT-2, Qwen2)
    ("vocab.txt",),                     # WordPiece (BERT)
)

COMPONENTS = ("vae", "text_encoder", "tokenizer", "scheduler")
TINY_WAN_FLOW_SHIFT = 3.0   # trainer.models.wan.tiny's scheduler (Wan2.1 T2V at 480p)
TINY_WAN_LATENT_CHANNELS = 4  # trainer.models.wan.tiny's VAE z_dim
# Wan2.2 A14B's experts: transformer/ denoises the high-noise timesteps (t >= boundary_ratio x
# num_train_timesteps, as WanPipeline compares them), transformer_2/ the rest.
HIGH_NOISE_EXPERT, LOW_NOISE_EXPERT = "transformer", "transformer_2"
TINY_WAN_BOUNDARY = 0.875   # the tiny A14B pipeline's boundary_ratio (Wan2.2 T2V A14B's)


def holds_tokenizer(directory) -> bool:
    """Whether `directory` holds one of TOKENIZER_FILE_SETS (or a *.tiktoken file)."""
    root = Path(directory)
    names = {p.name for p in root.iterdir()} if root.is_dir() else set()
    return any(all(f in names for f in files) for files in TOKENIZER_FILE_SETS) or \
        any(n.endswith(".tiktoken") for n in names)


def tokenizer_dir(text_encoder_dir) -> Path:
    """Where the tokenizer of a text encoder directory lives: the directory itself, or, in the
    diffusers pipeline layout, its sibling tokenizer/ (text_encoder/ and tokenizer/ side by
    side). The directory itself when neither holds one (the error then names it)."""
    root = Path(text_encoder_dir)
    sibling = root.parent / "tokenizer"
    if not holds_tokenizer(root) and holds_tokenizer(sibling):
        return sibling
    return root


def missing_tokenizer(directory) -> str | None:
    """Why the text encoder at `directory` has no tokenizer (one paragraph), or None when it or
    its sibling tokenizer/ holds one. Checked before transformers is asked, whose own error for
    a directory without tokenizer files advises installing sentencepiece or tiktoken."""
    root = Path(directory)
    if holds_tokenizer(tokenizer_dir(root)):
        return None
    names = {p.name for p in root.iterdir()} if root.is_dir() else set()
    wanted = ", ".join(" + ".join(files) for files in TOKENIZER_FILE_SETS)
    held = ", ".join(sorted(names)[:12]) + (", ..." if len(names) > 12 else "") or "nothing"
    return (f"the text encoder directory {root} holds no tokenizer, and neither does "
            f"{root.parent / 'tokenizer'} beside it: none of {wanted} is there (it holds {held}). "
            f"Copy the tokenizer files of the same model release into {root} or into a "
            f"tokenizer/ folder beside it, as a diffusers pipeline directory has them (e.g. "
            f"tokenizer.json and tokenizer_config.json, as AutoTokenizer.save_pretrained writes "
            f"them), or point at a directory that has them.")


def pipeline_root(path) -> Path | None:
    """The diffusers pipeline directory `path` names (it, or the pipeline one of whose
    component folders it is: transformer/, Wan2.2 A14B's transformer_2/, any folder its
    model_index.json lists), or None when it names none (a file, a relay checkpoint, a bare
    folder)."""
    if path is None:
        return None
    root = Path(path)
    if (root / "model_index.json").is_file():
        return root
    index = root.parent / "model_index.json"
    if not index.is_file() or not root.is_dir() and root.name not in ("transformer", "transformer_2"):
        return None
    try:
        listed = json.loads(index.read_text())
    except (OSError, ValueError):
        listed = {}
    if root.name in ("transformer", "transformer_2") or \
            (isinstance(listed, dict) and root.name in listed and not root.name.startswith("_")):
        return root.parent
    return None


def boundary_ratio(root) -> float | None:
    """The boundary_ratio of a Wan2.2 A14B pipeline directory (its model_index.json lists
    transformer_2 and sets boundary_ratio, a number in (0, 1)), or None for any other."""
    try:
        index = json.loads((Path(root) / "model_index.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or not isinstance(index.get(LOW_NOISE_EXPERT), list):
        return None
    value = index.get("boundary_ratio")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 < value < 1.0:
        return float(value)
    return None


def expert_range(name: str, boundary: float) -> list[float] | None:
    """The timesteps, as fractions [lo, hi] of the train timesteps, that WanPipeline gives the
    expert folder `name` of an A14B pipeline with `boundary`: transformer/ (high noise)
    [boundary, 1], transformer_2/ (low noise) [0, boundary]; None for another name."""
    return {HIGH_NOISE_EXPERT: [boundary, 1.0], LOW_NOISE_EXPERT: [0.0, boundary]}.get(name)


def tiny_wan_target(path) -> tuple[Path, float | None]:
    """Where make_tiny_wan writes trainer.models.wan.tiny's pipeline for the
    pretrained_transformer_path `path`, and its boundary_ratio: an expert folder's name
    (transformer/, transformer_2/) asks for the two-expert A14B layout in its parent
    (TINY_WAN_BOUNDARY); any other path for the one-transformer pipeline at the path itself."""
    path = Path(path)
    if path.name in (HIGH_NOISE_EXPERT, LOW_NOISE_EXPERT):
        return path.parent, TINY_WAN_BOUNDARY
    return path, None


def flow_shift(root) -> float | None:
    """The flow shift a pipeline's scheduler/scheduler_config.json ships (UniPC's flow_shift,
    FlowMatchEulerDiscrete's shift), or None when it has none or no scheduler/."""
    file = Path(root) / "scheduler" / "scheduler_config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    for key in ("flow_shift", "shift"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def pipeline_defaults(args: dict[str, Any], explicit: set[str] | frozenset[str],
                      needs_text_encoder: bool = True, draws_timesteps: bool = True,
                      family_defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The values a pipeline directory given as pretrained_transformer_path (with
    load_transformer_weights) supplies for the keys not in `explicit` (those the YAML or the
    command line set); {} when the run starts from no pipeline directory.
    `needs_text_encoder`: whether anything in the run encodes text (preflight's
    text_encoder_uses); without that, a directory lacking text_encoder/ gives no default.
    `draws_timesteps`: whether the run's stage draws flow matching's noise levels (an A14B
    expert's timestep range is given only then). `family_defaults`: what the model family's
    own pipeline uses (ModelFamily.pipeline_defaults: caption length, sampling steps and
    guidance)."""
    if not args.get("load_transformer_weights"):
        return {}
    path = args.get("pretrained_transformer_path")
    root = pipeline_root(path)
    unwritten = root is None and tiny_wan_pending(args)
    boundary = boundary_ratio(root) if root is not None else None
    if unwritten:
        root, boundary = tiny_wan_target(path)  # the tiny pipeline this run writes first
    if root is None:
        return {}
    found: dict[str, Any] = dict(family_defaults or {})
    # A directory without text_encoder/ still trains what needs no encoder (pre-encoded
    # captions, no validation, no dropout or guidance); a need is refused by preflight.
    if unwritten or (root / "text_encoder").is_dir() or needs_text_encoder:
        found["text_encoder"] = str(root / "text_encoder")
    validates = args.get("validation_interval", 0) >= 0
    if validates or (root / "vae").is_dir():
        found["vae_path"] = str(root / "vae")
    shift = flow_shift(root)
    if unwritten:
        shift = TINY_WAN_FLOW_SHIFT
    if shift is not None:
        found["train_timestep_shift"] = shift
    # An A14B expert trains on the timesteps WanPipeline gives it (flow matching's draws).
    span = expert_range(Path(path).name, boundary) if boundary is not None and \
        Path(path) != root else None
    if span is not None and draws_timesteps:
        found["train_timestep_range"] = span
    return {key: value for key, value in found.items() if key not in explicit}


def tiny_wan_pending(args: dict[str, Any]) -> bool:
    """Whether the run writes trainer.models.wan.tiny's pipeline first (make_tiny_wan, and
    nothing at pretrained_transformer_path yet; tiny_wan_target says where and which layout):
    its folders are then checked once written."""
    path = args.get("pretrained_transformer_path")
    return bool(args.get("make_tiny_wan")) and path is not None and not Path(path).exists()


def missing_component(root, key: str, directory, uses: list[str] = ()) -> str | None:
    """One paragraph when `directory`, the value of `key` defaulted from the pipeline directory
    `root`, is not there; None when it is (or when it is not one of root's folders). `uses`:
    what in the run needs it (text_encoder_uses), named with the setting that removes each."""
    directory = Path(directory)
    if directory.parent != Path(root):
        return None
    config = directory / "config.json"
    if config.is_file() and (key != "text_encoder" or holds_tokenizer(tokenizer_dir(directory))):
        return None
    what = {"vae_path": "vae/ (the AutoencoderKLWan validation decodes through)",
            "text_encoder": "text_encoder/ and tokenizer/ (the encoder of prompts and of the "
                            "null caption)"}[key]
    absent = directory.name + "/" if not config.is_file() else "tokenizer/"
    needed = (f" The run needs it for {'; '.join(uses)}." if uses else "")
    return (f"pretrained_transformer_path {root} is a diffusers pipeline directory, so the run "
            f"uses its {what}, but {absent} is missing or incomplete there.{needed} Fetch the "
            f"complete pipeline directory (model_index.json, transformer/, vae/, text_encoder/, "
            f"tokenizer/, scheduler/), set `{key}` to a directory that holds it"
            + (", or change the settings above so nothing needs it." if uses else "."))


def encoder_dirs(pipeline=None, vae=None, text_encoder=None,
                 names: dict[str, str] | None = None) -> tuple[str, str]:
    """(VAE directory, text encoder directory) for encoding: each given one, else the folder
    of the diffusers pipeline directory `pipeline` (vae/, text_encoder/ with tokenizer/ beside
    it). Raises ValueError in one paragraph naming what is missing; `names` maps "pipeline",
    "vae_path" and "text_encoder" to how the caller's user spells them (an option, a key)."""
    names = {"pipeline": "pipeline", "vae_path": "vae", "text_encoder": "text_encoder",
             **(names or {})}
    if pipeline is not None:
        root = pipeline_root(pipeline)
        if root is None:
            raise ValueError(f"{names['pipeline']} {pipeline} is not a diffusers pipeline "
                             f"directory (no model_index.json): point it at the directory that "
                             f"holds model_index.json, vae/, text_encoder/ and tokenizer/")
        vae = vae or str(root / "vae")
        text_encoder = text_encoder or str(root / "text_encoder")
        for key, value in (("vae_path", vae), ("text_encoder", text_encoder)):
            problem = missing_component(root, key, value)
            if problem:
                raise ValueError(problem.replace("pretrained_transformer_path", names["pipeline"])
                                 .replace("`vae_path`", names["vae_path"])
                                 .replace("`text_encoder`", names["text_encoder"]))
    if vae is None or text_encoder is None:
        raise ValueError(f"give {names['pipeline']} (a diffusers pipeline directory), or both "
                         f"{names['vae_path']} and {names['text_encoder']}")
    return str(vae), str(text_encoder)

