"""Does the per-op compute model reproduce ``autopar calibrate``'s own layer probes on this host?

    autopar calibrate --nproc 2 -o host.json
    python benchmarks/cpu_op_check.py host.json

``autopar calibrate`` times forward + backward of transformer layers (its
compute probes) and, separately, the per-op terms (GEMM shapes, an
elementwise add, attention). This captures each probe layer on the meta
device and prices it both ways — op by op with the measured per-op terms
(``calibration.op_model_fit`` on a CPU host, where the file keeps the FLOPs
model, or the device's ``op_model``), and by the FLOPs model the file was
fitted with — beside the measured seconds. It is why a CPU host's cluster
file keeps the FLOPs model (docs/cost-model.md "Compute model").
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch
import torch.nn as nn

import autopar
from autopar.cost_models.compute import compute_time_s
from autopar.cost_models.hardware import OpModel
from autopar.cost_models.presets import load_cluster
from autopar.planning.layer_compute import layer_compute


class _Stack(nn.Module):
    """Two of calibrate's probe layers, so capture makes each one a layer."""

    def __init__(self, width: int):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, max(1, width // 64), 4 * width, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cluster", help="a cluster file written by autopar calibrate")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    doc = json.load(open(args.cluster))
    cluster = load_cluster(args.cluster)
    device = cluster.device
    if device.op_model is None:
        fit = dict(doc["calibration"]["op_model_fit"])
        rate = fit.pop("gemm_rate_flops_s")
        peak = max(device.peak_flops_fp32, rate)
        device = replace(device, peak_flops_fp32=peak, matmul_efficiency=rate / peak, op_model=OpModel(**fit))
    print("| width | measured ms | per-op ms | FLOPs model ms |")
    print("|---:|---:|---:|---:|")
    for probe in doc["calibration"]["layers"]:
        with torch.device("meta"):
            net, x = _Stack(probe["width"]), torch.randn(args.batch, args.seq, probe["width"], requires_grad=True)
        layer = next(l for l in autopar.capture(net, (x,)) if l.name.startswith("layers."))
        per_op = layer_compute(layer, None, 1, args.batch, device, "fp32")
        flops = args.batch * layer.flops_per_sample
        by_flops = compute_time_s(flops, cluster.device, "fp32") + compute_time_s(2 * flops, cluster.device, "fp32")
        print(f"| {probe['width']} | {probe['seconds'] * 1e3:.2f} | {(per_op.fwd_s + per_op.bwd_s) * 1e3:.2f} | "
              f"{by_flops * 1e3:.2f} |")


if __name__ == "__main__":
    main()
