"""Tuned kernel configs per GPU model, as JSON files (vLLM's per-device config files).

One `ConfigTables` per kernel family (``w4a16``, ``kbit``). A file ``<family>-<device
name>.json`` (spaces in the name as ``_``, e.g. ``w4a16-NVIDIA_H200.json``) holds, per weight
shape, the config tuning picked at each tuned M::

    {"device": "NVIDIA H200", "source": "how and when it was tuned",
     "shapes": {"N=6144,K=4096,G=128": {"1": ["mma", 4, 8, 8, false, true, 4], ...}}}

The shape key names the family's shape fields (``N, K, G`` for W4A16, ``N, K, bits`` for
kbit). Files are searched in the folder named by the family's environment variable, then in
the package folder; the first file that lists the shape wins. A call with M tokens uses the
entry of the smallest tuned M >= M rounded up to a power of two (the bucket the runtime cache
keys calls by; past the largest tuned M, that one). Pure Python.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

Shape = tuple[int, ...]
Table = dict[Shape, dict[int, tuple]]


def check_fields(cfg: tuple, fields: dict[str, tuple[tuple[str, type], ...]], where: str) -> tuple:
    """`cfg` if it is a well-formed config tuple ``(kind, *values)`` for `fields` (kind ->
    (field name, int or bool) pairs; ints must be positive); a ValueError naming `where`."""
    kind = cfg[0] if cfg else None
    spec = fields.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise ValueError(f"{where}: unknown kernel kind {kind!r}; kinds: {', '.join(fields)}")
    want = f"({kind!r}, {', '.join(n for n, _ in spec)})"
    if len(cfg) != 1 + len(spec):
        raise ValueError(f"{where}: {list(cfg)} has {len(cfg) - 1} fields, {kind} takes {want}")
    for value, (name, typ) in zip(cfg[1:], spec):
        ok = (
            isinstance(value, bool)
            if typ is bool
            else (isinstance(value, int) and not isinstance(value, bool) and value > 0)
        )
        if not ok:
            kind_of = "True/False" if typ is bool else "a positive integer"
            raise ValueError(f"{where}: {name}={value!r} in {list(cfg)} must be {kind_of}; {want}")
    return tuple(cfg)


def m_bucket(M: int) -> int:
    """Configs are chosen per power-of-two bucket of the token count M."""
    return 1 << max(0, (M - 1).bit_length())


class ConfigTables:
    """The tuned tables of one kernel family: file naming, loading (checked), lookup, writing.

    `check(cfg, where)` returns a well-formed config tuple or raises a ValueError naming
    `where`."""

    def __init__(
        self,
        family: str,
        title: str,
        env_dir: str,
        package_dir: Path,
        shape_fields: tuple[str, ...],
        check: Callable[[tuple, str], tuple],
    ):
        self.family = family
        self.title = title
        self.env_dir = env_dir
        self.package_dir = package_dir
        self.shape_fields = shape_fields
        self.check = check
        self._cache: dict[tuple, tuple[Table, ...]] = {}

    def file_name(self, device_name: str) -> str:
        safe = device_name.strip().replace(" ", "_").replace("/", "_")
        return f"{self.family}-{safe}.json"

    def shape_key(self, *shape: int) -> str:
        return ",".join(f"{f}={v}" for f, v in zip(self.shape_fields, shape))

    def _parse_shape_key(self, key: str, path: Path) -> Shape:
        try:
            parts = dict(p.split("=") for p in key.split(","))
            if set(parts) != set(self.shape_fields):
                raise KeyError(key)
            return tuple(int(parts[f]) for f in self.shape_fields)
        except (ValueError, KeyError):
            form = ",".join(f"{f}=<{f}>" for f in self.shape_fields)
            raise ValueError(f"{path}: shape key {key!r} is not of the form {form!r}") from None

    def load_table(self, path: str | os.PathLike) -> Table:
        """{shape: {M: config}} from one file; every entry is checked, errors name the file."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            shapes = data["shapes"]
            items = shapes.items()
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a {self.title} config table ({e})") from None
        table: Table = {}
        for key, per_m in items:
            entry = {}
            for m, cfg in per_m.items():
                where = f"{path}: {key} M={m}"
                if not str(m).isdigit() or int(m) < 1:
                    raise ValueError(f"{where}: M must be a positive integer")
                entry[int(m)] = self.check(tuple(cfg), where)
            table[self._parse_shape_key(key, path)] = dict(sorted(entry.items()))
        return table

    def search_dirs(self) -> list[Path]:
        user = os.environ.get(self.env_dir)
        return ([Path(user)] if user else []) + [self.package_dir]

    def _tables(self, device_name: str) -> tuple[Table, ...]:
        dirs = tuple(self.search_dirs())
        key = (device_name, dirs)
        if key not in self._cache:
            name = self.file_name(device_name)
            self._cache[key] = tuple(
                self.load_table(d / name) for d in dirs if (d / name).is_file()
            )
        return self._cache[key]

    def cache_clear(self) -> None:
        self._cache.clear()

    def find_config(self, device_name: str, M: int, *shape: int) -> tuple | None:
        """The tabled config for this GPU model, shape and M (the entry of the smallest tuned M
        >= M's power-of-two bucket), or None when no file lists the shape."""
        bucket = m_bucket(M)
        for table in self._tables(device_name):
            per_m = table.get(tuple(shape))
            if per_m:
                return next((c for m, c in per_m.items() if m >= bucket), per_m[max(per_m)])
        return None

    def write_table(
        self, path: str | os.PathLike, device_name: str, configs: Table, source: str
    ) -> Path:
        """Merge `configs` into the table at `path` (created if missing; new entries win)."""
        path = Path(path)
        shapes: dict[str, dict[str, list]] = {}
        if path.is_file():
            for shape, per_m in self.load_table(path).items():
                shapes[self.shape_key(*shape)] = {str(m): list(c) for m, c in per_m.items()}
        for shape, per_m in configs.items():
            key = self.shape_key(*shape)
            entry = shapes.setdefault(key, {})
            for m, cfg in per_m.items():
                entry[str(m)] = list(self.check(tuple(cfg), f"{key} M={m}"))
            shapes[key] = dict(sorted(entry.items(), key=lambda kv: int(kv[0])))
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(shapes.items()))
        head = f'{{\n "device": {json.dumps(device_name)},\n "source": {json.dumps(source)},\n'
        path.write_text(head + ' "shapes": {\n' + rows + "\n }\n}\n")  # one line per shape
        self.cache_clear()
        return path
