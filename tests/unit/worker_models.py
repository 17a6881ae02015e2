"""Small models a user could bring, written as the files the registry stores: a torch
``nn.Sequential`` 13 -> 16 -> 3 exported to ONNX (dynamic batch axis) and to TorchScript (with
its input signature in the archive), for the worker runtime, inspection and agent tests."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np

SIGNATURE_FILE = "heteroplane/signature.json"
N_IN, N_HIDDEN, N_OUT = 13, 16, 3


def tabular_model() -> Any:
    """The 13 -> 16 -> 3 model, seeded, in eval mode."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(N_IN, N_HIDDEN), nn.ReLU(), nn.Linear(N_HIDDEN, N_OUT))
    return model.eval()


def torch_outputs(model: Any, inputs: np.ndarray) -> np.ndarray:
    """What torch itself computes for ``inputs`` (the reference the runtimes must match)."""
    import torch

    with torch.inference_mode():
        result: np.ndarray = model(torch.from_numpy(inputs.astype(np.float32))).numpy()
    return result


def export_onnx(model: Any, path: Path, *, dynamic: bool = True) -> Path:
    """``model`` as ONNX: input ``input`` (-1 x 13), output ``logits`` (-1 x 3); ``dynamic=False``
    fixes the batch dimension at 1 (a model heteroplane cannot batch)."""
    import torch

    axes = {"input": {0: "batch"}, "logits": {0: "batch"}} if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
        torch.onnx.export(
            model,
            (torch.zeros(1, N_IN),),
            str(path),
            dynamo=False,
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes=axes,
        )
    return path


def export_torchscript(model: Any, path: Path, *, signature: Any = "default") -> Path:
    """``model`` scripted and saved with ``signature`` (the ``{"inputs": [...]}`` document;
    ``"default"``: input ``input`` FP32 [-1, 13]; ``None``: no extra file) in the archive."""
    import torch

    if signature == "default":
        signature = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, N_IN]}]}
    extra = {SIGNATURE_FILE: json.dumps(signature)} if signature is not None else {}
    torch.jit.save(torch.jit.script(model), str(path), _extra_files=extra)
    return path


def sample_inputs(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, N_IN)).astype(np.float32)
