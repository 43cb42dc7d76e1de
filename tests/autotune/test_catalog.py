"""The hardware catalog: the built-in file, YAML and CSV input, --link, and one-line errors."""

import pytest

from fastml_strategy.autotune.catalog import FIELDS, DEFAULT_CATALOG, load_catalog, parse_link

ROW = dict(name="a", nodes=4, accelerators_per_node=2, price_per_hour=1.5, bandwidth_gbps=10,
           latency_us=30, compute_speed=1.0)


def test_builtin_catalog_is_complete_and_priced():
    opts = load_catalog()
    assert len(opts) >= 2
    assert any(o.bandwidth_gbps <= 25 for o in opts) and any(o.bandwidth_gbps >= 100 for o in opts)
    cheap = min(opts, key=lambda o: o.price_per_hour)
    dear = max(opts, key=lambda o: o.price_per_hour)
    assert dear.price_per_hour > 5 * cheap.price_per_hour
    assert DEFAULT_CATALOG.suffix == ".yaml"


def test_yaml_and_csv_read_the_same(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("options:\n" + "".join(
        f"  {'-' if i == 0 else ' '} {k}: {v}\n" for i, (k, v) in enumerate(ROW.items())))
    c = tmp_path / "c.csv"
    c.write_text(",".join(ROW) + "\n" + ",".join(str(v) for v in ROW.values()) + "\n")
    [a], [b] = load_catalog(y), load_catalog(c)
    assert a == b
    assert a.ranks == 8
    assert a.link.bandwidth_Bps == pytest.approx(10e9 / 8)
    assert a.link.latency_s == pytest.approx(30e-6)


@pytest.mark.parametrize("field", list(FIELDS))
def test_missing_field_names_option_and_field(tmp_path, field):
    row = {k: v for k, v in ROW.items() if k != field}
    c = tmp_path / "c.csv"
    c.write_text(",".join(row) + "\n" + ",".join(str(v) for v in row.values()) + "\n")
    with pytest.raises(ValueError) as e:
        load_catalog(c)
    msg = str(e.value)
    assert field in msg and "option 1" in msg and "\n" not in msg


@pytest.mark.parametrize("field,value", [("nodes", "0"), ("nodes", "2.5"), ("price_per_hour", "-1"),
                                         ("bandwidth_gbps", "fast"), ("compute_speed", "0")])
def test_bad_values_are_refused(tmp_path, field, value):
    row = dict(ROW, **{field: value})
    c = tmp_path / "c.csv"
    c.write_text(",".join(row) + "\n" + ",".join(str(v) for v in row.values()) + "\n")
    with pytest.raises(ValueError, match=field):
        load_catalog(c)


def test_other_catalog_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_catalog(tmp_path / "nope.yaml")
    bad = tmp_path / "c.yaml"
    bad.write_text("options: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_catalog(bad)
    dup = tmp_path / "d.csv"
    dup.write_text(",".join(ROW) + "\n" + ("\n".join([",".join(str(v) for v in ROW.values())] * 2)) + "\n")
    with pytest.raises(ValueError, match="more than once"):
        load_catalog(dup)
    txt = tmp_path / "c.txt"
    txt.write_text("x")
    with pytest.raises(ValueError, match="suffix"):
        load_catalog(txt)


@pytest.mark.parametrize("text,bps,lat", [("1gbit", 1e9, 50e-6), ("10Gbps", 10e9, 50e-6),
                                          ("100mbit,200us", 100e6, 200e-6), ("2.5gbit,1ms", 2.5e9, 1e-3)])
def test_parse_link(text, bps, lat):
    link = parse_link(text)
    assert link.bandwidth_Bps == pytest.approx(bps / 8)
    assert link.latency_s == pytest.approx(lat)


@pytest.mark.parametrize("text", ["fast", "1", "0gbit", "1gbit,"])
def test_parse_link_rejects(text):
    with pytest.raises(ValueError, match="--link"):
        parse_link(text)
