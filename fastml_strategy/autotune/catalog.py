"""The hardware catalog: the clusters a user could rent, and the link of the cluster they have.

A catalog is a YAML file (a list of options, or ``{options: [...]}``) or a CSV file with one option per
row. Every option names all of :data:`FIELDS`; a missing or malformed field is an error that names the
file, the option and the field, raised before any profiling starts. The built-in
``default_catalog.yaml`` (next to this module) holds a cheap Ethernet cluster, a bigger Ethernet one,
an expensive InfiniBand one at on-demand cloud prices, and spot instances in two regions joined by
200 Mbit/s (where local steps, ``LocalSGD``, are meant to win).

``--link RATE`` describes the user's own cluster without a catalog entry: ``1gbit``, ``10gbit``,
``25gbps``, ``100mbit``, optionally with a latency, ``1gbit,50us``.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HardwareOption", "Link", "FIELDS", "DEFAULT_CATALOG", "load_catalog", "parse_link"]

DEFAULT_CATALOG = Path(__file__).with_name("default_catalog.yaml")

# name -> (type, constraint text, check)
FIELDS: dict[str, tuple[type, str]] = {
    "name": (str, "a non-empty label"),
    "nodes": (int, "a whole number >= 1"),
    "accelerators_per_node": (int, "a whole number >= 1"),
    "price_per_hour": (float, "USD per node-hour, >= 0"),
    "bandwidth_gbps": (float, "Gbit/s per node, > 0"),
    "latency_us": (float, "microseconds, >= 0"),
    "compute_speed": (float, "relative to the profiling machine, > 0"),
}


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: sending ``n`` bytes in one message takes ``latency_s + n / bandwidth_Bps``.

    ``bandwidth_Bps`` is what ONE rank gets (bytes per second): when ranks share a link, as in the
    emulated single-link setup of benchmarks/bench_allreduce.py, a measured value already includes the
    sharing.
    """

    bandwidth_Bps: float
    latency_s: float
    source: str = "given"  # "measured", "catalog" or "given": shown in the report

    def describe(self) -> str:
        return f"{self.rate_words()}, {self.latency_words()} ({self.source})"

    def rate_words(self) -> str:
        """``"200 Mbit/s"``, ``"10 Gbit/s"``: the link rate in the unit people quote it in."""
        gbit = self.bandwidth_Bps * 8 / 1e9
        return f"{gbit:.3g} Gbit/s" if gbit >= 1 else f"{gbit * 1e3:.3g} Mbit/s"

    def latency_words(self) -> str:
        """``"50 us"``, ``"33 ms"``: the one-way latency per message."""
        us = self.latency_s * 1e6
        return f"{us:.3g} us" if us < 1000 else f"{us / 1e3:.3g} ms"


@dataclass(frozen=True)
class HardwareOption:
    """One cluster a user could run on (see ``default_catalog.yaml`` for what each field means)."""

    name: str
    nodes: int
    accelerators_per_node: int
    price_per_hour: float
    bandwidth_gbps: float
    latency_us: float
    compute_speed: float
    # Set for the user's own cluster (from --link or measured collectives): overrides the catalog link.
    measured_link: Link | None = None
    # Sharded training: the link between ranks of one node (None: the run's --intra-node-link).
    intra_link: Link | None = None

    @property
    def ranks(self) -> int:
        return self.nodes * self.accelerators_per_node

    @property
    def link(self) -> Link:
        if self.measured_link is not None:
            return self.measured_link
        return Link(self.bandwidth_gbps * 1e9 / 8, self.latency_us * 1e-6, "catalog")


def _coerce(value: Any, kind: type, where: str, field: str, rule: str) -> Any:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{where} has an empty field {field!r}; give {rule}")
    try:
        if kind is str:
            out: Any = str(value).strip()
        elif kind is int:
            if isinstance(value, bool):
                raise ValueError
            f = float(value)
            if f != int(f):
                raise ValueError
            out = int(f)
        else:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
            if not math.isfinite(out):
                raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{where}: field {field!r} is {value!r}; give {rule}") from None
    ok = {
        "name": lambda v: bool(v),
        "nodes": lambda v: v >= 1,
        "accelerators_per_node": lambda v: v >= 1,
        "price_per_hour": lambda v: v >= 0,
        "bandwidth_gbps": lambda v: v > 0,
        "latency_us": lambda v: v >= 0,
        "compute_speed": lambda v: v > 0,
    }[field](out)
    if not ok:
        raise ValueError(f"{where}: field {field!r} is {value!r}; give {rule}")
    return out


def _option(entry: Any, where: str) -> HardwareOption:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not a mapping of field: value; each option needs {list(FIELDS)}")
    label = f"{where} ({entry.get('name')!r})" if entry.get("name") else where
    missing = [f for f in FIELDS if f not in entry]
    if missing:
        raise ValueError(
            f"{label} is missing field(s) {missing}; every option needs {', '.join(FIELDS)}"
        )
    unknown = sorted(set(entry) - set(FIELDS))
    if unknown:
        raise ValueError(f"{label} has unknown field(s) {unknown}; the fields are {', '.join(FIELDS)}")
    values = {f: _coerce(entry[f], kind, label, f, rule) for f, (kind, rule) in FIELDS.items()}
    return HardwareOption(**values)


def load_catalog(path: str | Path | None = None) -> list[HardwareOption]:
    """Read and validate a catalog (``None``: the built-in one). Raises ValueError with a one-line
    message naming the file, the option and the field when something is missing or wrong."""
    p = Path(path) if path is not None else DEFAULT_CATALOG
    where = f"catalog {str(p)!r}"
    if not p.is_file():
        raise ValueError(f"{where} does not exist; give a YAML or CSV file (see {DEFAULT_CATALOG.name})")
    suffix = p.suffix.lower()
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"{where} cannot be read ({e.strerror}); check the path and its permissions") from None
    if suffix == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
        entries: list[Any] = [{k.strip(): v for k, v in r.items() if k is not None} for r in rows]
    elif suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{where} is not valid YAML ({first}); fix the syntax") from None
        if isinstance(data, dict) and "options" in data:
            data = data["options"]
        if not isinstance(data, list):
            raise ValueError(f"{where} must hold a list of options (or 'options: [...]'), "
                             f"got {type(data).__name__}")
        entries = data
    else:
        raise ValueError(f"{where} has suffix {suffix!r}; use .yaml, .yml or .csv")
    if not entries:
        raise ValueError(f"{where} lists no options; add at least one with fields {', '.join(FIELDS)}")
    options = [_option(e, f"{where} option {i + 1}") for i, e in enumerate(entries)]
    names = [o.name for o in options]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{where} names option(s) {dup} more than once; give each option its own name")
    bad = [n for n in names if not re.fullmatch(r"[A-Za-z0-9_.\-]+", n)]
    if bad:
        raise ValueError(f"{where}: option name(s) {bad} contain characters other than letters, digits, "
                         f"'.', '_' and '-'; rename them (names become file names)")
    return options


_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_link(text: str) -> Link:
    """``1gbit``, ``10Gbps``, ``100mbit``, ``2.5gbit``, optionally ``,50us`` / ``,0.2ms``; bandwidth in
    bits per second, one direction, per rank. Default latency: 50 us (TCP over Ethernet)."""
    s = text.strip().lower().replace(" ", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)([kmgt])(?:bit|bps|b/s|bit/s)?(?:,([0-9]*\.?[0-9]+)(us|ms|s))?", s)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(
            f"--link {text!r} is not a link rate; write e.g. 1gbit, 10gbit, 100mbit or 1gbit,50us"
        )
    bits = float(m.group(1)) * _UNITS[m.group(2)]
    latency = 50e-6
    if m.group(3):
        latency = float(m.group(3)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(4)]
    return Link(bits / 8, latency, "given")
