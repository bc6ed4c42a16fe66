"""Data files shipped inside the package, so a wheel-installed kvgate needs no checkout.

`qwen3-14b/`: the Qwen3 tokenizer, chat template and config.json (Apache-2.0, see its
NOTICE) that `kvgate demo`, `kvgate sim` and `kvgate local-stack` count with.
`nginx-local.conf.template`: the load balancer `kvgate local-stack` renders.
Paths come from the installed package (importlib.resources), never the working
directory, so they resolve alike in a checkout, a wheel install and the image.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["BUNDLED_MODEL_NAME", "bundled_file", "bundled_model_dir"]

BUNDLED_MODEL_NAME = "qwen3-14b"


def bundled_file(name: str) -> Path:
    """A file or folder of this package as a real path (tokenizers and nginx need one)."""
    resource = resources.files(__name__).joinpath(name)
    if not isinstance(resource, Path):  # a zipped install: nothing here reads from zips
        raise RuntimeError(f"kvgate's bundled {name!r} is not on the file system: {resource}")
    if not resource.exists():
        raise RuntimeError(f"kvgate's bundled {name!r} is missing at {resource}; "
                           "the installation is incomplete")
    return resource


def bundled_model_dir() -> Path:
    """The bundled Qwen3 model directory (tokenizer.json, tokenizer_config.json, config.json)."""
    return bundled_file(BUNDLED_MODEL_NAME)
