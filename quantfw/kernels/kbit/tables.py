"""Tuned kbit kernel configs per GPU model (`quantfw.kernels.common.tables` format).

Files ``kbit-<device name>.json`` keyed by ``N=<out>,K=<in>,bits=<bits>``, searched in
``QUANTFW_KBIT_CONFIG_DIR``, then in the package's ``kernels/kbit/tuned`` (shipped: H200, the
Qwen3-8B gate_up and down shapes at K = 2 and 4, from ``benchmarks/bench_kbit.py``). Shapes no
file lists get ``configs.default_config``. Pure Python.
"""

from __future__ import annotations

from pathlib import Path

from quantfw.kernels.common.tables import ConfigTables
from quantfw.kernels.kbit.configs import check_config, default_config

ENV_DIR = "QUANTFW_KBIT_CONFIG_DIR"
PACKAGE_DIR = Path(__file__).parent / "tuned"

TABLES = ConfigTables("kbit", "kbit", ENV_DIR, PACKAGE_DIR, ("N", "K", "bits"), check_config)


def untuned_config(
    device_name: str, M: int, N: int, K: int, bits: int, wgmma: bool = False
) -> tuple:
    """The config of a call that no ``tune()`` covered. Where the wgmma kernel may run
    (`wgmma`: sm_90, a call made for CUDA graphs) the default if it is that kernel's tile
    (`configs.wgmma_tile`); else the table entry for this GPU model, shape and M bucket (a
    wgmma entry only where the kernel may run), else the heuristic ``default_config``."""
    default = default_config(M, N, K, bits, wgmma)
    if default[0] == "wgmma":
        return default
    tabled = TABLES.find_config(device_name, M, N, K, bits)
    if tabled is not None and (wgmma or tabled[0] != "wgmma"):
        return tabled
    return default
