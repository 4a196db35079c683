"""Tuned W4A16 kernel configs per GPU model (`quantfw.kernels.common.tables` format).

Files ``w4a16-<device name>.json`` keyed by ``N=<out>,K=<in>,G=<group size>``, searched in
``QUANTFW_W4A16_CONFIG_DIR`` (written by ``quantfw tune-w4a16``), then in the package's
``kernels/w4a16/tuned``. Shapes no file lists get ``configs.default_config``. Pure Python.
"""

from __future__ import annotations

from pathlib import Path

from quantfw.kernels.common.tables import ConfigTables
from quantfw.kernels.w4a16.configs import check_config, default_config

ENV_DIR = "QUANTFW_W4A16_CONFIG_DIR"
PACKAGE_DIR = Path(__file__).parent / "tuned"

TABLES = ConfigTables("w4a16", "W4A16", ENV_DIR, PACKAGE_DIR, ("N", "K", "G"), check_config)

file_name = TABLES.file_name
shape_key = TABLES.shape_key
load_table = TABLES.load_table
search_dirs = TABLES.search_dirs
find_config = TABLES.find_config
write_table = TABLES.write_table


def untuned_config(device_name: str, M: int, N: int, K: int, G: int, hopper: bool) -> tuple:
    """The config of a call that no ``tune()`` covered: the table entry for this GPU model,
    shape and M bucket, else the heuristic ``default_config``."""
    tabled = find_config(device_name, M, N, K, G)
    return tabled if tabled is not None else default_config(M, N, K, G, hopper)
