"""Tuned W4A16 kernel configs per GPU model, as JSON files (vLLM's per-device config files).

A file ``w4a16-<device name>.json`` (spaces in the name as ``_``, e.g.
``w4a16-NVIDIA_H200.json``) holds, per weight shape, the config ``tune()`` picked at each
tuned M::

    {"device": "NVIDIA H200", "source": "how and when it was tuned",
     "shapes": {"N=6144,K=4096,G=128": {"1": ["mma", 4, 8, 8, false, true, 4], ...}}}

Files are searched in the folder named by ``QUANTFW_W4A16_CONFIG_DIR`` (written by
``quantfw tune-w4a16``), then in the package's ``kernels/configs``; the first file that lists
the shape wins.  A call with M tokens uses the entry of the smallest tuned M >= M rounded up
to a power of two (the bucket the runtime cache keys calls by; past the largest tuned M, that
one).  Shapes no file lists get ``w4a16_configs.default_config``.  Pure Python.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from quantfw.kernels.w4a16_configs import check_config, default_config, m_bucket

ENV_DIR = "QUANTFW_W4A16_CONFIG_DIR"
PACKAGE_DIR = Path(__file__).parent / "configs"

Shape = tuple[int, int, int]  # N (out features), K (in features), G (group size)


def file_name(device_name: str) -> str:
    return "w4a16-" + device_name.strip().replace(" ", "_").replace("/", "_") + ".json"


def shape_key(N: int, K: int, G: int) -> str:
    return f"N={N},K={K},G={G}"


def _parse_shape_key(key: str, path: Path) -> Shape:
    try:
        parts = dict(p.split("=") for p in key.split(","))
        return int(parts["N"]), int(parts["K"]), int(parts["G"])
    except (ValueError, KeyError):
        raise ValueError(
            f"{path}: shape key {key!r} is not of the form 'N=<out>,K=<in>,G=<group size>'"
        ) from None


def load_table(path: str | os.PathLike) -> dict[Shape, dict[int, tuple]]:
    """{(N, K, G): {M: config}} from one file; every entry is checked, errors name the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        shapes = data["shapes"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a W4A16 config table ({e})") from None
    table: dict[Shape, dict[int, tuple]] = {}
    for key, per_m in shapes.items():
        entry = {}
        for m, cfg in per_m.items():
            where = f"{path}: {key} M={m}"
            if not str(m).isdigit() or int(m) < 1:
                raise ValueError(f"{where}: M must be a positive integer")
            entry[int(m)] = check_config(tuple(cfg), where)
        table[_parse_shape_key(key, path)] = dict(sorted(entry.items()))
    return table


def search_dirs() -> list[Path]:
    user = os.environ.get(ENV_DIR)
    return ([Path(user)] if user else []) + [PACKAGE_DIR]


@functools.cache
def _tables(device_name: str, dirs: tuple[Path, ...]) -> tuple[dict[Shape, dict[int, tuple]], ...]:
    name = file_name(device_name)
    return tuple(load_table(d / name) for d in dirs if (d / name).is_file())


def find_config(device_name: str, M: int, N: int, K: int, G: int) -> tuple | None:
    """The tabled config for this GPU model, shape and M (the entry of the smallest tuned M >=
    M's power-of-two bucket), or None when no file lists the shape."""
    bucket = m_bucket(M)
    for table in _tables(device_name, tuple(search_dirs())):
        per_m = table.get((N, K, G))
        if per_m:
            return next((c for m, c in per_m.items() if m >= bucket), per_m[max(per_m)])
    return None


def untuned_config(device_name: str, M: int, N: int, K: int, G: int, hopper: bool) -> tuple:
    """The config of a call that no ``tune()`` covered: the table entry for this GPU model,
    shape and M bucket, else the heuristic ``default_config``."""
    tabled = find_config(device_name, M, N, K, G)
    return tabled if tabled is not None else default_config(M, N, K, G, hopper)


def write_table(
    path: str | os.PathLike,
    device_name: str,
    configs: dict[Shape, dict[int, tuple]],
    source: str,
) -> Path:
    """Merge ``configs`` into the table at ``path`` (created if missing; new entries win)."""
    path = Path(path)
    shapes: dict[str, dict[str, list]] = {}
    if path.is_file():
        for (n, k, g), per_m in load_table(path).items():
            shapes[shape_key(n, k, g)] = {str(m): list(c) for m, c in per_m.items()}
    for (n, k, g), per_m in configs.items():
        entry = shapes.setdefault(shape_key(n, k, g), {})
        for m, cfg in per_m.items():
            entry[str(m)] = list(check_config(tuple(cfg), f"{shape_key(n, k, g)} M={m}"))
        shapes[shape_key(n, k, g)] = dict(sorted(entry.items(), key=lambda kv: int(kv[0])))
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(shapes.items()))
    head = f'{{\n "device": {json.dumps(device_name)},\n "source": {json.dumps(source)},\n'
    path.write_text(head + ' "shapes": {\n' + rows + "\n }\n}\n")  # one line per shape
    _tables.cache_clear()
    return path
