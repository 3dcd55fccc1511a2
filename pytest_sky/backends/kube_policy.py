"""What a cluster's pods ask of the nodes and the namespace: GPU node labels, requests, limits.

Pure functions over plain data (node labels, accelerator names), no client: the backend
feeds them what it read from the API server, and the unit tests feed them label values seen
on real clusters.

**GPU type.** Kubernetes counts ``nvidia.com/gpu`` devices but does not tell an A100 from a
T4; node labels do, and each installation spells them its own way (SkyPilot's
``kubernetes_utils`` label formatters are the reference for these keys and values):

- GPU feature discovery (the NVIDIA GPU operator, most on-prem clusters and kind with GPUs):
  ``nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB``, ``Tesla-T4``, ``NVIDIA-H100-80GB-HBM3``
- GKE: ``cloud.google.com/gke-accelerator=nvidia-tesla-a100``, ``nvidia-a100-80gb``, ``nvidia-l4``
- EKS with Karpenter: ``karpenter.k8s.aws/instance-gpu-name=a100``, ``t4``
- SkyPilot's own labeller: ``skypilot.co/accelerator=a100``
- CoreWeave: ``gpu.nvidia.com/class=A100_NVLINK_80GB``; Nebius: ``nebius.com/gpu-name=H100``

A value *matches* a requested name when, both reduced to upper-case tokens split at ``-``,
``_`` and spaces, with the vendor words (``NVIDIA``, ``TESLA``, ``GEFORCE``) dropped and
``RTX`` joined to the next token, the first tokens are equal and every token of the request
appears in the value: ``A100`` matches ``NVIDIA-A100-SXM4-80GB`` and ``nvidia-tesla-a100``,
``A100-80GB`` matches ``nvidia-a100-80gb`` but not ``NVIDIA-A100-SXM4-40GB``, and ``A10``
matches neither (tokens, not substrings).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: GPU feature discovery's label: the key used when nothing else is known.
GFD_LABEL = "nvidia.com/gpu.product"
GKE_LABEL = "cloud.google.com/gke-accelerator"
KARPENTER_LABEL = "karpenter.k8s.aws/instance-gpu-name"
SKYPILOT_LABEL = "skypilot.co/accelerator"
COREWEAVE_LABEL = "gpu.nvidia.com/class"
NEBIUS_LABEL = "nebius.com/gpu-name"
#: Every GPU product key known, in the order a cluster's nodes are searched for one
#: (SkyPilot's order: its own label first, then the clouds', then GPU feature discovery's).
KNOWN_GPU_LABELS = (SKYPILOT_LABEL, GKE_LABEL, KARPENTER_LABEL, GFD_LABEL, COREWEAVE_LABEL, NEBIUS_LABEL)

_VENDOR_WORDS = {"NVIDIA", "TESLA", "GEFORCE"}
#: GPU feature discovery's spellings of common products, for when the nodes cannot be listed
#: (a namespaced Role) or none has the GPU yet (an autoscaler adds it on demand).
_GFD_PRODUCTS = {
    "A100": ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-PCIE-40GB", "NVIDIA-A100-80GB-PCIe"),
    "A100-80GB": ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"),
    "H100": ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe", "NVIDIA-H100-NVL"),
    "H200": ("NVIDIA-H200", "NVIDIA-H200-141GB-HBM3"),
    "V100": ("Tesla-V100-SXM2-16GB", "Tesla-V100-SXM2-32GB", "Tesla-V100-PCIE-16GB", "Tesla-V100-PCIE-32GB"),
    "T4": ("Tesla-T4",),
    "P100": ("Tesla-P100-PCIE-16GB", "Tesla-P100-SXM2-16GB"),
    "K80": ("Tesla-K80",),
}


@dataclass(frozen=True)
class GpuSelector:
    """The pods' required node affinity: the node label ``key`` has one of ``values``."""

    key: str
    values: tuple[str, ...]
    accelerator: str  # the name the task asked for, for messages

    def describe(self) -> str:
        return f"a node labelled {self.key} matching {self.accelerator}"


def _tokens(text: str) -> list[str]:
    words = [w for w in re.split(r"[-_\s]+", text.upper()) if w and w not in _VENDOR_WORDS]
    out: list[str] = []
    for word in words:
        if out and out[-1] == "RTX":
            out[-1] = "RTX" + word
        else:
            out.append(word)
    return out


def matches(requested: str, value: str) -> bool:
    """Whether node label ``value`` names the GPU ``requested`` (rules in the module docstring)."""
    want, have = _tokens(requested), _tokens(value)
    return bool(want and have) and want[0] == have[0] and all(t in have for t in want)


def _spellings(key: str, accelerator: str) -> tuple[str, ...]:
    """How ``key``'s installation spells ``accelerator`` when no node shows it (a guess per
    convention; the nodes' own values, when they can be read, take precedence)."""
    name = accelerator.upper()
    if key == GKE_LABEL:
        gke = "H100-80GB" if name == "H100" else name
        if gke in ("A100-80GB", "L4", "H100-80GB", "H100-MEGA-80GB", "H200-141GB", "B200"):
            return (f"nvidia-{gke.lower()}",)
        return (f"nvidia-tesla-{gke.lower()}",)
    if key in (KARPENTER_LABEL, SKYPILOT_LABEL):
        return (accelerator.lower(),)
    if key == GFD_LABEL:
        return tuple(sorted({*_GFD_PRODUCTS.get(name, ()), f"NVIDIA-{name}", f"Tesla-{name}"}))
    return (accelerator, name)


def gpu_key(nodes: Iterable[Mapping[str, str]] | None, configured: str | None) -> str | None:
    """The label key that names GPU products here: the configured one; else the first known
    key any node carries; else, where the nodes cannot be listed, GPU feature discovery's.
    None when the nodes were listed and none names its GPU product: nothing tells an A100
    node from a T4 one there, so the pods go wherever ``nvidia.com/gpu`` is."""
    if configured:
        return configured
    if nodes is None:
        return GFD_LABEL
    seen = {k for labels in nodes for k in labels}
    return next((k for k in KNOWN_GPU_LABELS if k in seen), None)


def gpu_selector(
    accelerator: str, nodes: Sequence[Mapping[str, str]] | None, configured: str | None
) -> GpuSelector | None:
    """The node affinity that keeps ``accelerator`` pods on nodes with that GPU (None: no
    node label names GPU products, see :func:`gpu_key`).

    ``nodes``: every node's labels, or None where they cannot be listed.  The values are the
    matching ones the nodes carry, plus the convention's spellings (so a node an autoscaler
    adds later still qualifies); if none matches, the pods stay Pending and the scheduler's
    "didn't match Pod's node affinity/selector" says why.
    """
    key = gpu_key(nodes, configured)
    if key is None:
        return None
    seen = {labels[key] for labels in nodes or () if key in labels}
    found = {v for v in seen if matches(accelerator, v)}
    guessed = {v for v in _spellings(key, accelerator) if matches(accelerator, v) or key not in KNOWN_GPU_LABELS}
    return GpuSelector(key=key, values=tuple(sorted(found | guessed)), accelerator=accelerator)


def node_affinity(selector: GpuSelector) -> dict:
    """``requiredDuringSchedulingIgnoredDuringExecution`` for the pod spec's ``affinity``."""
    return {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": selector.key, "operator": "In", "values": list(selector.values)}]}
            ]
        }
    }
