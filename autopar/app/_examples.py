"""The example models (``examples/`` of the source checkout), by name, for the CLI.

``autopar demo`` and ``autopar plan --model gpt-1.3B`` use the models in the repository's
``examples/`` folder. That folder is not part of the installed package: it sits next to
``autopar/`` in the source checkout, which is where an editable install
(``pip install -e .``) runs from. `load_example` imports it from there, so the CLI works
from a checkout with or without installing, and says what to do when the folder is missing
(a non-editable install).

Model names are ``<family>-<size>``: a family (`FAMILIES`) and a key of that example's
``CONFIGS``, e.g. ``gpt-1.3B``, ``moe-tiny``, ``wide_resnet-250M``, ``mlp-wide``, ``llama-8B``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

FAMILIES = ("gpt", "moe", "wide_resnet", "mlp", "llama", "moe_dropless")
EXAMPLES_PACKAGE = "examples"
# The demo and `autopar plan` train with AdamW, as the GPT, MoE and Wide-ResNet examples do;
# the plan depends on the optimizer state's shapes, not on the learning rate.
LEARNING_RATE = 1e-2


@dataclass(frozen=True)
class NamedModel:
    """An example model at one size, ready to plan: a train step and abstract arguments."""

    name: str
    config: Any
    train_step: Callable
    abstract_state: Any
    abstract_batch: Any


def examples_dir() -> Path:
    """The ``examples/`` folder of the source checkout this autopar runs from.

    Raises ValueError when autopar was installed without its source checkout.
    """
    folder = Path(__file__).resolve().parents[2] / EXAMPLES_PACKAGE  # autopar/app/ -> checkout
    if not (folder / "gpt.py").is_file():
        raise ValueError(
            f"the example models are not installed (looked for {folder}/gpt.py). They live "
            "in the source checkout: clone the autopar repository and install it editable, "
            '`pip install -e ".[all]"`, or run from the checkout.'
        )
    return folder


def load_example(family: str) -> ModuleType:
    """Import ``examples/<family>.py`` (e.g. ``"gpt"``) from the source checkout."""
    if family not in FAMILIES:
        raise ValueError(f"unknown example {family!r}; choose one of {', '.join(FAMILIES)}")
    try:
        import optax  # noqa: F401  (the examples' optimizer)
    except ImportError as err:
        raise ImportError(
            "the example models need optax, which is not installed; install the examples "
            "extra: pip install autopar[examples]   (or: pip install optax)"
        ) from err
    folder = examples_dir()
    package = sys.modules.get(EXAMPLES_PACKAGE)
    if package is None:
        spec = importlib.util.spec_from_file_location(
            EXAMPLES_PACKAGE, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[EXAMPLES_PACKAGE] = package
        spec.loader.exec_module(package)
    elif folder not in {Path(p).resolve() for p in getattr(package, "__path__", ())}:
        raise ValueError(
            f"a different package named {EXAMPLES_PACKAGE!r} is already imported "
            f"({getattr(package, '__file__', package)}); autopar needs {folder}. Run from "
            "another folder, or import autopar's examples before the other package."
        )
    return importlib.import_module(f"{EXAMPLES_PACKAGE}.{family}")


def model_names() -> list[str]:
    """Every ``<family>-<size>`` name `named_model` accepts."""
    return [f"{family}-{size}" for family in FAMILIES for size in load_example(family).CONFIGS]


def parse_model_name(name: str) -> tuple[str, str]:
    """``"wide_resnet-250M"`` -> ``("wide_resnet", "250M")``; ValueError listing the names."""
    family, _, size = name.partition("-")
    if family in FAMILIES and size in load_example(family).CONFIGS:
        return family, size
    raise ValueError(
        f"unknown model {name!r}: a name is <family>-<size>, one of: {', '.join(model_names())}"
    )


def named_model(name: str, batch_size: int, *, layer_markers: bool = False,
                seq_len: int | None = None) -> NamedModel:
    """The example model `name` (e.g. ``"gpt-1.3B"``) with a batch of `batch_size`.

    `layer_markers`: trace with the layers marked (``layer_boundary``) where the example's
    config has that option, so that Megatron plans can pipeline it.
    `seq_len`: tokens per sequence instead of the config's (the families with a sequence:
    gpt, llama, moe); the positional tables and the batch follow it.

    **Returns:** a `NamedModel` whose `abstract_state` and `abstract_batch` are
    `jax.ShapeDtypeStruct` trees (nothing is allocated), trained by ``optax.adamw``.
    """
    if batch_size < 1:
        raise ValueError(f"the batch size must be >= 1, got {batch_size}")
    family, size = parse_model_name(name)
    import optax

    module = load_example(family)
    config = module.CONFIGS[size]
    import dataclasses

    if layer_markers and hasattr(config, "layer_markers"):
        config = dataclasses.replace(config, layer_markers=True)
    if seq_len is not None:
        if not hasattr(config, "seq_len"):
            with_sequence = [f for f in FAMILIES
                             if hasattr(next(iter(load_example(f).CONFIGS.values())), "seq_len")]
            raise ValueError(
                f"--seq-len: {name} has no sequence length (a {family} takes no tokens); "
                f"it applies to the families {', '.join(with_sequence)}"
            )
        if seq_len < 1:
            raise ValueError(f"the sequence length must be >= 1, got {seq_len}")
        config = dataclasses.replace(config, seq_len=seq_len)
    optimizer = optax.adamw(LEARNING_RATE)
    return NamedModel(
        name=name,
        config=config,
        train_step=module.make_train_step(config, optimizer),
        abstract_state=module.abstract_state(config, optimizer),
        abstract_batch=module.abstract_batch(config, batch_size),
    )
