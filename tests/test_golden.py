"""No number changes: a seeded tiny run of FedEvi and GraphFedSeg through its FLARE Recipe in SimEnv gives the final
global model and the results table recorded in tests/golden/golden_runs.json (tools/golden_runs.py; FedAvg's is
tests/test_recipe.py's command-line run). The suite checks these three to stay within its time; every other job
(FedA3I, FIVA-P, the CT jobs, FedAvgM, FedPer, ...) is checked by ``tools/golden_runs.py --check`` before and after a
restructuring, as docs/development.md asks. The record was made with the committed jobs in
``nvflare simulator`` before FedUQ's jobs became Recipes; re-record only for a change that is meant to change the
numbers, and say so in the commit. ``tests/golden/golden_runs.<cpu>.json`` holds the same commit's runs on another
kind of CPU (float32 rounds differently across instruction sets); a run must equal one of the records."""

import pytest

from conftest import load_tool


@pytest.mark.sim
@pytest.mark.parametrize("method", ["fedevi", "graphfedseg"])
def test_a_tiny_seeded_run_gives_the_recorded_model_and_table(tmp_path, data_root, method):
    golden = load_tool("golden_runs")
    got = golden.run(method, data_root, tmp_path)
    lines = golden.check(got, method)  # the record, or the same commit's record on another kind of CPU
    assert lines == [], "\n".join(lines)
    assert got["tables"]["per_client_table.csv"]  # a table was compared
