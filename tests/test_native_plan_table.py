"""``benchmarks/native_plan_table.py``: which confirmed sweep cases become plan-table entries, the M
ranges they serve, and the refusals (no GPU needed); and that each shipped table is what its committed
sweeps give."""
from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


@pytest.fixture
def tool(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import native_plan_table
    return native_plan_table


def _plan(**kw):
    return {"nwn": 4, "splits": 1, "cluster": False, "xfull": True, "ring": 0, "minb": 1, "fold": False, "prefetch": 0,
            "smem_ring": 0, "xu": 8} | kw


def _case(n, k, m, rule_us, *others):
    """A confirmed case: the rule's plan first (as sweep_native writes it), then (plan, us) pairs."""
    confirmed = [{"plan": _plan(), "us": rule_us}] + [{"plan": p, "us": us} for p, us in others]
    return {"N": n, "K": k, "M": m, "confirmed": confirmed}


def _sweep(*cases, **extra):
    return {"gpu": "NVIDIA H200", "sms": 132, "smem_optin": 227 * 1024 - 1024, "cases": list(cases)} | extra


def test_m_ranges_start_after_the_previous_measured_m(tool):
    assert tool.m_ranges([16, 1, 8, 4]) == {1: (1, 1), 4: (2, 4), 8: (5, 8), 16: (9, 16)}
    assert tool.m_ranges([8]) == {8: (1, 8)}


def test_only_cases_beating_the_rule_by_the_margin_become_entries(tool):
    wide = _plan(nwn=8, splits=2, cluster=True)
    sweep = _sweep(_case(28672, 4096, 1, 10.0, (wide, 9.8)),        # 2%: below the margin
                   _case(28672, 4096, 8, 20.0, (wide, 15.0), (_plan(nwn=2), 16.0)),  # the fastest wins
                   {"N": 28672, "K": 4096, "M": 16, "measured": []})  # never confirmed: ignored
    table = tool.build([sweep], ["s.json"], 0.03)
    assert table["gpu"] == "NVIDIA H200" and table["sms"] == 132
    [e] = table["plans"]
    assert (e["n"], e["k"], e["m_min"], e["m_max"], e["measured_at_m"]) == (28672, 4096, 2, 8, 8)
    # 224 blocks on 132 SMs: swept at two blocks an SM, so two are promised (measured_minb)
    assert e["plan"] == wide | {"minb": 2} and (e["us"], e["rule_us"], e["source"]) == (15.0, 20.0, "s.json")


def test_grids_of_more_blocks_than_sms_promise_two_blocks_an_sm(tool):
    from qops.native import int_weight as native

    one_wave = native.make_plan(1, 4096, 4096, nwn=4, splits=4, cluster=False, xfull=True, minb=1)  # 32 tiles x 4
    assert one_wave.tiles * one_wave.splits <= 132 and tool.measured_minb(one_wave, 132) == 1
    two = native.make_plan(8, 28672, 4096, nwn=8, splits=2, cluster=True, xfull=True, minb=1)  # 112 tiles x 2
    assert tool.measured_minb(two, 132) == 2 and tool.measured_minb(two, 264) == 1
    tall = native.make_plan(24, 28672, 4096, nwn=8, splits=2, cluster=True, xfull=False, minb=1)  # MT 3: one block an SM
    assert tool.measured_minb(tall, 132) == 1


def test_the_shipped_tables_promise_two_blocks_an_sm_where_their_grids_need_them():
    """A table plan was measured at two blocks an SM wherever its grid has more blocks than SMs; a build
    taking more than 128 registers would run at one (the compile test holds minb = 2 builds to 128)."""
    from qops.native import int_weight as native

    for table in native.plan_tables().values():
        for e in table["plans"]:
            for m in range(e["m_min"], e["m_max"] + 1):
                p = native.make_plan(m, e["n"], e["k"], **e["plan"])
                if p.tiles * p.splits > table["sms"] and p.mt <= 2:
                    assert p.minb >= 2, (e, m)


def test_refusals(tool):
    with pytest.raises(SystemExit, match="several GPUs"):
        tool.build([_sweep(), _sweep(gpu="NVIDIA H100")], ["a", "b"], 0.03)
    with pytest.raises(SystemExit, match="float16 sweeps; got \\['bfloat16', 'float16'\\]"):
        tool.build([_sweep(), _sweep(dtype="bfloat16", default_plans="table")], ["a", "b"], 0.03)
    with pytest.raises(SystemExit, match="QOPS_NATIVE_PLANS=rule"):
        tool.build([_sweep(default_plans="table")], ["a"], 0.03)  # a refresh with nothing to refresh
    with pytest.raises(SystemExit, match="QOPS_NATIVE_PLANS=rule"):
        tool.build([_sweep(), _sweep(default_plans="table"), _sweep()], ["a", "b", "c"], 0.03)  # rule sweeps first
    folded = _plan(fold=True)  # folding needs M <= 8: an M = 16 entry cannot take it
    with pytest.raises(SystemExit, match="does not serve M=9"):
        tool.build([_sweep(_case(4096, 4096, 8, 10.0), _case(4096, 4096, 16, 10.0, (folded, 5.0)))], ["a"], 0.03)


@pytest.mark.parametrize("stem", ["h200", "h100"])
def test_each_shipped_table_is_its_committed_sweeps(tool, stem):
    """Rebuilt from the sweeps it names, with the cases it passed over passed over again."""
    from qops.native import int_weight as native

    shipped = json.load(open(os.path.join(ROOT, "qops", "native", "plans", f"{stem}.json")))
    assert {e["source"] for e in shipped["plans"]} <= set(shipped["sweeps"])
    paths = [os.path.join(RESULTS, s) for s in shipped["sweeps"]]
    assert all(os.path.exists(p) for p in paths), shipped["sweeps"]
    pass_over = [(p["n"], p["k"], p["m"]) for p in shipped.get("passed_over", [])]
    rebuilt = tool.build([json.load(open(p)) for p in paths], paths, shipped["min_gain"], pass_over)
    assert rebuilt == shipped
    assert native.plan_tables()[shipped["gpu"]] == shipped


def test_a_passed_over_case_takes_its_next_fastest_plan_if_that_still_beats_the_rule(tool):
    spills, next_best, close = _plan(nwn=8, splits=4, cluster=True, ring=3), _plan(nwn=8, splits=4, cluster=True), _plan(nwn=2)
    sweep = _sweep(_case(57344, 8192, 16, 121.0, (next_best, 109.4), (spills, 109.0)),
                   _case(28672, 4096, 16, 30.0, (spills, 25.0), (close, 29.5)))  # next fastest within 2% of the rule
    table = tool.build([sweep], ["s.json"], 0.03, [(57344, 8192, 16), (28672, 4096, 16)])
    [e] = table["plans"]
    assert (e["n"], e["k"], e["us"]) == (57344, 8192, 109.4) and e["plan"]["ring"] == 0
    assert [(p["n"], p["k"], p["m"], p["us"], p["plan"]["ring"]) for p in table["passed_over"]] == [
        (28672, 4096, 16, 25.0, 3), (57344, 8192, 16, 109.0, 3)]
    with pytest.raises(SystemExit, match="fastest plan is the default"):
        tool.build([_sweep(_case(4096, 4096, 1, 5.0, (close, 6.0)))], ["s.json"], 0.03, [(4096, 4096, 1)])
    assert "passed_over" not in tool.build([sweep], ["s.json"], 0.03)
    assert tool.parse_case("57344x8192:16") == (57344, 8192, 16)


def test_a_sweep_of_the_table_replaces_only_what_it_beats(tool):
    """A sweep timed with the table in force (its default the table's plan) replaces an entry where its best
    beats that plan by the margin, adds one where the rule served, and leaves every other entry; the new
    entries serve the rows from the shape's previous measured M."""
    wide, narrow, split = _plan(nwn=8, splits=2, cluster=True), _plan(nwn=2), _plan(nwn=4, splits=4, cluster=True)
    rule = _sweep(_case(28672, 4096, 1, 10.0), _case(28672, 4096, 4, 20.0, (narrow, 15.0)),
                  _case(28672, 4096, 8, 30.0, (wide, 20.0)))
    first = tool.build([rule], ["r.json"], 0.03)
    assert [(e["m_min"], e["m_max"]) for e in first["plans"]] == [(2, 4), (5, 8)]

    def table_case(m, default, us, *others):
        return {"N": 28672, "K": 4096, "M": m, "confirmed": [{"plan": default, "us": us}] + [{"plan": p, "us": t} for p, t in others]}

    refresh = _sweep(table_case(1, _plan(), 10.0, (split, 9.0)),       # the rule served M = 1: a new entry
                     table_case(4, narrow, 15.0, (split, 14.8)),       # 1.3%: the entry stays
                     table_case(8, wide, 20.0, (split, 18.0)),         # 10%: replaced
                     default_plans="table")
    table = tool.build([rule, refresh], ["r.json", "t.json"], 0.03)
    got = {e["measured_at_m"]: e for e in table["plans"]}
    assert sorted(got) == [1, 4, 8] and table["sweeps"] == ["r.json", "t.json"]
    assert (got[1]["m_min"], got[1]["m_max"], got[1]["source"], got[1]["rule_us"]) == (1, 1, "t.json", 10.0)
    assert got[4] == first["plans"][0]
    assert got[8]["plan"]["nwn"] == 4 and (got[8]["m_min"], got[8]["m_max"], got[8]["us"]) == (5, 8, 18.0)
    assert got[8]["rule_us"] == 30.0  # the rule's time from the sweep that first made the entry


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """qops.native.int_weight reads its plan tables from an empty temporary directory (caches cleared)."""
    from qops.native import int_weight as native

    caches = (native._plan_table_files, native.plan_table, native.measured_plan)
    monkeypatch.setattr(native, "PLAN_TABLE_DIR", str(tmp_path))
    for c in caches:
        c.cache_clear()
    yield tmp_path
    for c in caches:
        c.cache_clear()


def _shipped_h200() -> dict:
    return json.load(open(os.path.join(ROOT, "qops", "native", "plans", "h200.json")))


@pytest.mark.parametrize("change, why", [
    (lambda e: e["plan"].update(lut=True), r"plan fields \['lut'\] are not table fields"),  # an int call would launch the codebook build
    (lambda e: e["plan"].update(spilts=2), r"plan fields \['spilts'\] are not table fields"),
    (lambda e: e.update(n=str(e["n"])), r"n must be integers \(got '3584'\)"),  # would silently never match
    (lambda e: e["plan"].pop("xu"), r"plan fields missing or not of their type: xu \(int\)"),
    (lambda e: e["plan"].update(fold=1), r"plan fields missing or not of their type: fold \(bool\)"),
    (lambda e: e.update(m_max=16) or e["plan"].update(fold=True), r"its plan does not serve M=9: native_w4a16: fold needs"),
], ids=["lut", "misspelt", "string-n", "missing", "int-for-bool", "m-range"])
def test_a_malformed_table_fails_its_gpu_only_naming_the_file_and_entry(table_dir, change, why):
    from qops.native import int_weight as native

    table = _shipped_h200()
    change(table["plans"][3])
    (table_dir / "h200.json").write_text(json.dumps(table))
    (table_dir / "other.json").write_text(json.dumps(_shipped_h200() | {"gpu": "NVIDIA A100-SXM4-80GB", "sms": 108}))
    with pytest.raises(ValueError, match=rf"plan table \S*h200.json, entry 3: {why}"):
        native.measured_plan(1, 4096, 4096, "NVIDIA H200", 132, True, native.SHMEM_OPTIN_MAX_BYTES)
    assert native.plan_table("NVIDIA H100 80GB HBM3") is None  # a GPU without a table takes the rule
    assert native.plan_table("NVIDIA A100-SXM4-80GB")[1]["sms"] == 108  # and another GPU's table still serves


def test_a_table_file_naming_no_gpu_is_skipped_with_a_warning(table_dir):
    from qops.native import int_weight as native

    text = json.dumps(_shipped_h200())
    (table_dir / "h200.json").write_text(text)
    (table_dir / "cut.json").write_text(text[: len(text) // 2])  # a copy cut short
    (table_dir / "nameless.json").write_text(json.dumps(_shipped_h200() | {"gpu": None}))
    with pytest.warns(UserWarning) as seen:
        assert native.plan_table("NVIDIA A100-SXM4-80GB") is None
    assert len(seen) == 2
    assert "cut.json is not readable JSON" in str(seen[0].message) and "nameless.json names no GPU" in str(seen[1].message)
    assert native.plan_tables() == {"NVIDIA H200": _shipped_h200()}


def test_two_tables_of_one_gpu_fail_that_gpu_only(table_dir):
    from qops.native import int_weight as native

    for name in ("a.json", "b.json"):
        (table_dir / name).write_text(json.dumps(_shipped_h200()))
    with pytest.raises(ValueError, match=r"two plan tables for 'NVIDIA H200' \(\S*a.json, \S*b.json\)"):
        native.plan_table("NVIDIA H200")
    assert native.plan_table("NVIDIA A100-SXM4-80GB") is None


def test_the_table_builder_writes_exactly_the_fields_qops_reads(tool):
    from qops.native import int_weight as native

    table = tool.build([_sweep(_case(28672, 4096, 8, 20.0, (_plan(nwn=8, splits=2, cluster=True), 15.0)))], ["s.json"], 0.03)
    assert list(table["plans"][0]["plan"]) == list(native.PLAN_FIELDS)
    native.check_plan_table("built", table)


def test_info_names_the_measured_tables_a_gpu_reads_and_where_it_has_none(monkeypatch):
    """`python -m qops info` on a GPU says which measured tables apply: the H200 and the H100 (SXM) read
    their own Triton configs, native plan tables and slice limits; an H100 PCIe (114 SMs) reads the SXM's
    Triton configs (its name's prefix), the plan rule (no table at its SM count) and the H200's slice limits
    (none measured on it); a GPU without files (an A100) is told it runs the untuned generic Triton table
    and the plan rule; a table applies only at the SM count it was measured with."""
    from qops.__main__ import measured_tables
    from qops.native import int_weight as native_int_weight

    h200 = measured_tables("NVIDIA H200", 132)
    entries = len(native_int_weight.plan_table("NVIDIA H200")[1]["plans"])
    assert h200[0].startswith("Triton int-weight launch configs: configs/h200.json (measured: ") and "UNTUNED" not in h200[0]
    assert h200[1] == f"Native W4A16 plan table: plans/h200.json ({entries} measured plans; other shapes take the rule)"
    h100 = measured_tables("NVIDIA H100 80GB HBM3", 132)
    entries = len(native_int_weight.plan_table("NVIDIA H100 80GB HBM3")[1]["plans"])
    assert h100[0].startswith("Triton int-weight launch configs: configs/h100.json (measured: ") and "on NVIDIA H100" in h100[0]
    assert h100[1] == f"Native W4A16 plan table: plans/h100.json ({entries} measured plans; other shapes take the rule)"
    pcie = measured_tables("NVIDIA H100 PCIe", 114)
    assert pcie[0] == h100[0]
    assert pcie[1] == ("Native W4A16 plan table: none for 'NVIDIA H100 PCIe' with 114 SMs, every shape takes the rule "
                       "(tables: NVIDIA H100 80GB HBM3 (132 SMs), NVIDIA H200 (132 SMs))")
    a100 = measured_tables("NVIDIA A100-SXM4-80GB", 108)
    assert a100[0] == ("Triton int-weight launch configs: configs/default.json, UNTUNED: no measured file for "
                       "'NVIDIA A100-SXM4-80GB' (measured files: h100, h200)")
    assert a100[1].startswith("Native W4A16 plan table: none for 'NVIDIA A100-SXM4-80GB' with 108 SMs")
    assert measured_tables("NVIDIA H200", 60)[1].startswith("Native W4A16 plan table: none for 'NVIDIA H200' with 60 SMs")
    assert h200[2] == ("Native W4A16 slices past 64 rows (Hopper; more go to Triton): up to 192 for >= 2^26 elements, "
                       "160 for >= 2^25 elements, 96 for >= 2^24 elements, 64 below (measured on NVIDIA H200)")
    assert h100[2] == ("Native W4A16 slices past 64 rows (Hopper; more go to Triton): up to 320 for >= 2^26 elements, "
                       "192 for >= 2^25 elements, 96 for >= 2^24 elements, 64 below (measured on NVIDIA H100 80GB HBM3)")
    assert pcie[2].endswith("(the NVIDIA H200's, none measured on 'NVIDIA H100 PCIe')") and pcie[2].rsplit(" (", 1)[0] == h200[2].rsplit(" (", 1)[0]
    assert all(len(lines) == 4 and lines[3].startswith("fp8, int8 and 4-bit codebook kernels") for lines in (h200, h100, pcie, a100))

    def malformed(gpu):
        raise ValueError("two plan tables")

    monkeypatch.setattr(native_int_weight, "plan_table", malformed)
    broken = measured_tables("NVIDIA H200", 132)
    assert broken[1] == "Native W4A16 plan table: unavailable (ValueError: two plan tables)" and len(broken) == 4
