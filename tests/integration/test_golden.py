"""No number changes: a seeded tiny run of FedEvi and GraphFedSeg through its FLARE Recipe in SimEnv gives the final
global model and the results table recorded in tests/golden/golden_runs.json (tools/golden_runs.py; FedAvg's is
tests/integration/test_recipe.py's command-line run). The suite checks these three to stay within its time; every other job
(FedA3I, FIVA-P, the CT jobs, FedAvgM, FedPer, ...) is checked by ``tools/golden_runs.py --check`` before and after a
restructuring, as docs/reference/development.md asks. The record was made with the committed jobs in
``nvflare simulator`` before FedUQ's jobs became Recipes; re-record only for a change that is meant to change the
numbers, and say so in the commit. ``tests/golden/golden_runs.<cpu>.json`` holds the same commit's runs on another
kind of CPU (float32 rounds differently across instruction sets): a run is compared with its machine's kind's record,
and skipped, naming the kind, where that kind has none."""

import pytest

from conftest import load_tool


@pytest.mark.sim
@pytest.mark.parametrize("method", ["fedevi", "graphfedseg"])
def test_a_tiny_seeded_run_gives_the_recorded_model_and_table(tmp_path, data_root, method):
    golden = load_tool("golden_runs")
    if golden.record_of(method) is None:
        pytest.skip(f"no golden record of {method} for this kind of CPU ({golden.cpu_kind()})")
    got = golden.run(method, data_root, tmp_path)
    lines = golden.check(got, method)  # the record made on this kind of CPU
    assert lines == [], "\n".join(lines)
    assert got["tables"]["per_client_table.csv"]  # a table was compared


def test_records_are_per_kind_of_cpu():
    """The kind comes from /proc/cpuinfo's flags; each kind has its own record file, and a job the kind has no record
    of is named with the command that records it (never compared with another kind's numbers)."""
    golden = load_tool("golden_runs")
    amx = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_fp16 amx_bf16 amx_tile\n"
    assert golden.cpu_kind(amx) == "avx512fp16-amx"
    assert golden.cpu_kind(amx.replace(" amx_tile", "")) == "amxbf16"  # trains in bfloat16: not the default's
    assert golden.cpu_kind("flags\t\t: fpu avx2 avx512f avx512_bf16\n") == "avx512bf16"
    assert golden.cpu_kind("flags\t\t: fpu avx2 avx512f\nbugs\t\t: avx512_bf16\n") == "default"
    assert golden.cpu_kind("") == "default"
    assert golden.record_path("default").name == "golden_runs.json"
    assert golden.record_path("avx512fp16-amx").name == "golden_runs.avx512fp16-amx.json"
    with pytest.raises(golden.NoRecord, match=r"no golden record of 'no-such-job' for this kind of CPU \('default', "
                                              r"tests/golden/golden_runs.json\): record it with"):
        golden.check({"model": {}, "tables": {}}, "no-such-job", kind="default")


@pytest.mark.sim
def test_the_polyp_task_as_a_task_file_with_sites_in_nnunets_layout_gives_the_record(tmp_path, data_root):
    """The built-in polyp task re-expressed as a task file (nnU-Net's dataset.json + "feduq"), its two sites written
    as nnU-Net raw datasets (PNG files, labels 0/1, the committed splits as case lists, tests/nnunet_sites.py): the
    same tiny FedEvi run gives the built-in task's record, model and table, exactly."""
    import nnunet_sites

    golden = load_tool("golden_runs")
    if golden.record_of("fedevi") is None:
        pytest.skip(f"no golden record of fedevi for this kind of CPU ({golden.cpu_kind()})")
    sites = golden.GOLDEN["fedevi"]["sites"]
    task = nnunet_sites.polyp_task(data_root, tmp_path / "data", sites, golden.TINY["max_items"])
    got = golden.run("fedevi", tmp_path / "data", tmp_path / "work", task=str(task))
    lines = golden.check(got, "fedevi")
    assert lines == [], "\n".join(lines)
    assert set(got["tables"]["per_client_table.csv"]) == set(golden.record_of("fedevi")["tables"]["per_client_table.csv"])
