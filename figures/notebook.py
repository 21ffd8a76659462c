"""What the kvscope notebooks (``notebooks/``) share: applying their run parameters and showing a figure they save.

A notebook calls each stage's library function (a typed config and a function returning records), never its CLI.
"""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.figure import Figure

from figures.save import save_figure


def prepare(out_dir: str | os.PathLike, *, torch_threads: int = 1, data_dir: str | os.PathLike | None = None) -> Path:
    """Apply a notebook's common parameters; returns its output folder.

    One torch thread by default: on a shared or small CPU, torch's spinning worker threads cost far more than they
    give. `data_dir` overrides ``KVSCOPE_DATA_DIR``, where the benchmarks' problem files are read from.
    """
    import torch

    torch.set_num_threads(torch_threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if data_dir is not None:
        os.environ["KVSCOPE_DATA_DIR"] = str(data_dir)
    return Path(out_dir)


def show(fig: Figure, fig_dir: str | os.PathLike, stem: str) -> list[Path]:
    """Save `fig` as ``fig_dir/stem.png`` and ``.pdf`` and display the PNG in the notebook."""
    from IPython.display import Image, display

    paths = save_figure(fig, fig_dir, stem)
    display(Image(filename=str(paths[0])))
    return paths
