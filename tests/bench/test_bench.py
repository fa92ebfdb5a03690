"""The benchmark's code paths on tiny sizes (digits, 2 rounds). No timing is asserted: speed is
measured on demand with ``fedbayes bench``, never in the test suite."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedbayes import bench as fb
from fedbayes.cli import app
from fedbayes.data import idx
from fedbayes.sim.hostdevices import num_cores

ROOT = Path(__file__).resolve().parents[2]
TINY = fb.BenchSettings(
    dataset="digits",
    hidden=(16,),
    large_batch=128,
    rounds=2,
    limit_reps=2,
    repeats=1,
    image_shape=(4, 4, 1),
    curvature_models=("mlp",),
    relative_reps=2,
    cnn_clients=2,
    cnn_per_client=16,
    cnn_batch=8,
    idle_probes=2,
    own_limit_blocks=1,
    own_limit_rounds=2,
)
# Every throughput workload but the GPU record's, of which one runs here (its layout on the CPU).
THROUGHPUT = [n for n, w in fb.WORKLOADS.items() if not fb.is_relative(n) and (not w.gpu or n == "gpu_fedavg_10")]
REQUIRED = ("examples_per_s", "ratio_to_limit", "compile_s", "peak_rss_mb", "round_s")


def _positive_finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def repeat():
    """One repeat of every registered throughput workload, measured in this process."""
    rep = {}
    for name, w in fb.WORKLOADS.items():
        if name not in THROUGHPUT:
            continue  # relative workloads are measured once per bench, tested below
        if isinstance(w, fb.LimitWorkload):
            rep[name] = fb.limit_entry([fb.measure_limit(w, TINY)])  # one share: processes are tested below
        else:
            rep[name] = fb.federated_entry(fb.measure_federated(w, TINY))
    return rep


def test_every_workload_reports_the_required_numbers(repeat):
    results = json.loads(json.dumps(fb.summarize([repeat])))
    assert list(results) == THROUGHPUT
    for name, entry in results.items():
        for k in REQUIRED:
            assert k in entry, (name, k)
        for k in ("examples_per_s", "ratio_to_limit", "peak_rss_mb", "round_s"):
            assert _positive_finite(entry[k]), (name, k, entry[k])
        assert math.isfinite(entry["compile_s"])
    assert results[fb.REFERENCE]["ratio_to_limit"] == 1.0
    fed = results["fedavg"]
    assert _positive_finite(fed["startup_s"]) and fed["rounds"] == TINY.rounds
    assert fed["examples_per_round"] == 1437  # digits' train split, all 10 clients, one epoch
    assert results["fedavg_100"]["rounds"] == fb.steady_rounds(fb.WORKLOADS["fedavg_100"], TINY)
    assert results["fedavg_100"]["clients_per_round"] == 10
    assert results["fedavg_dirichlet"]["client_sizes"]["min"] < results["fedavg_dirichlet"]["client_sizes"]["max"]
    # Each device's busy time in the client phase (2 devices here), and the share spent waiting.
    for name in ("fedavg", "fedavg_dirichlet", "fedep_100"):
        e = results[name]
        assert len(e["device_busy_s"]) == 2 and all(_positive_finite(b) for b in e["device_busy_s"]), name
        assert 0.0 <= e["device_idle"] <= e["device_idle_max"] < 1.0, name
    assert results["fedep_100"]["store"] == "device" and results["fedep_100_host"]["store"] == "memory"
    # Every workload measures a healthy run: no message rejected in its timed rounds.
    assert {n: e["rejected"] for n, e in results.items() if "rejected" in e} == {n: 0 for n in THROUGHPUT if n in results and "startup_s" in results[n]}


def test_posterior_workloads_report_ratios_to_fedavg_at_the_same_epochs(repeat):
    results = json.loads(json.dumps(fb.summarize([repeat])))
    for name, base in (("fedpa", "fedavg_e3"), ("fedep", "fedavg_e3"), ("fedpa_100", "fedavg_e3_100"), ("fedep_100", "fedavg_e3_100")):
        entry = results[name]
        assert entry["algorithm"] == name.split("_")[0] and entry["epochs"] == 3 == results[base]["epochs"]
        assert entry["baseline"] == base and _positive_finite(entry["startup_s"])
        assert entry[fb.BASELINE_RATIO] == pytest.approx(entry["examples_per_s"] / results[base]["examples_per_s"])
        assert entry["clients_per_round"] == results[base]["clients_per_round"] and entry["num_clients"] == results[base]["num_clients"]
    assert results["fedpa"]["examples_per_round"] == results["fedep"]["examples_per_round"] == 3 * 1437  # 3 epochs of every client
    assert fb.BASELINE_RATIO not in results["fedavg"] and fb.BASELINE_RATIO not in results["fedavg_e3"]
    assert all(fb.WORKLOADS[n].algorithm in fb.algorithm_names() for n in results if isinstance(fb.WORKLOADS[n], fb.FederatedWorkload))
    table = fb.markdown(results)
    assert "vs FedAvg" in table and "3 epochs" in table


def test_repeats_are_medians_with_ranges_and_ratios_within_each_repeat(repeat):
    slower = {name: {**e, "examples_per_s": e["examples_per_s"] / 2} for name, e in repeat.items()}
    results = fb.summarize([repeat, slower, repeat])
    fed = results["fedavg"]
    assert fed["repeats"] == 3
    assert fed["examples_per_s"] == repeat["fedavg"]["examples_per_s"]
    assert fed["examples_per_s_range"] == [slower["fedavg"]["examples_per_s"], repeat["fedavg"]["examples_per_s"]]
    # Halving everything in one repeat leaves that repeat's ratio unchanged.
    ratio = repeat["fedavg"]["examples_per_s"] / repeat[fb.REFERENCE]["examples_per_s"]
    assert fed["ratio_range"] == pytest.approx([ratio, ratio])
    # So does the ratio to FedAvg at the same epochs.
    vs = repeat["fedpa"]["examples_per_s"] / repeat["fedavg_e3"]["examples_per_s"]
    assert results["fedpa"][fb.BASELINE_RATIO] == pytest.approx(vs)
    assert results["fedpa"][fb.BASELINE_RATIO + "_range"] == pytest.approx([vs, vs])
    assert "fedavg" in fb.markdown(results) and len(fb.rows(results)) == len(results)
    results["fedpa"].update({fb.PAIRED_RATIO: 0.9, fb.PAIRED_RATIO + "_range": [0.8, 1.0]})
    assert "0.90 (0.80-1.00)" in fb.markdown(results)


def test_profile_rows_name_functions(repeat):
    raw = fb.measure_federated(fb.WORKLOADS["fedavg"], TINY, profile_top=5)
    assert len(raw["profile"]) == 5
    assert all(r["own_s"] >= 0 and r["calls"] > 0 and r["function"] for r in raw["profile"])


def test_each_measurement_reports_its_timed_rounds_and_ends_in_one_line(monkeypatch, capsys):
    """A federated worker reports its rounds (throttled lines the parent reads back); the driver
    gives every measurement a step, updated with those rounds and finished with its result line."""
    report = fb.progress_lines(interval_s=60.0)
    for done in (0, 1, 2):
        report(done, 2)
    lines = capsys.readouterr().out.splitlines()
    assert [fb.progress_of(line) for line in lines] == [(0, 2), (2, 2)]  # round 1 within the interval: left out
    assert fb.progress_of(fb.RESULT_PREFIX + "{}") is None
    rounds = []
    raw = fb.measure_federated(fb.WORKLOADS["fedavg"], TINY, on_round=lambda done, total: rounds.append((done, total)))
    assert rounds == [(0, 3), (1, 3), (2, 3), (3, 3)] and len(raw["round_s"]) == 2  # the last: its measurements after the rounds
    limit = [fb.measure_limit(fb.WORKLOADS[fb.REFERENCE], TINY)]

    def federated(workload, settings, progress):
        for done, total in rounds:
            progress(done, total)
        return raw

    monkeypatch.setattr(fb.run, "run_federated_process", federated)
    monkeypatch.setattr(fb.run, "run_limit_processes", lambda workload, settings: limit)
    seen = []

    class Recorded:
        def __init__(self, label):
            self.label, self.updates = label, []
            seen.append(self)

        def update(self, done, total):
            self.updates.append((done, total))

        def finish(self, line):
            self.line = line

    fb.run_bench(TINY, ["fedavg"], steps=Recorded)
    assert [s.label.split() for s in seen] == [["repeat", "1/1", fb.REFERENCE], ["repeat", "1/1", "fedavg"]]
    assert seen[0].updates == [] and seen[1].updates == rounds  # a limit reports no rounds: its bar only moves
    assert all(re.fullmatch(r" *[\d,]+ examples/s  \(\d+\.\d s\)", s.line) for s in seen)
    logged = []
    fb.run_bench(TINY, ["fedavg"], log=logged.append)  # without steps: the line of each as it ends
    assert [line.split()[:3] for line in logged] == [["repeat", "1/1", fb.REFERENCE], ["repeat", "1/1", "fedavg"]]
    assert all(line.endswith(" s)") and "examples/s" in line for line in logged)


def test_paired_rounds_interleave_workloads_and_give_per_pass_ratios():
    raw = fb.measure_paired(["fedavg_e3", "fedpa", "fedep"], TINY, rounds=2, block=1)
    assert all(len(raw["round_s"][n]) == 2 and all(t > 0 for t in raw["round_s"][n]) for n in ("fedavg_e3", "fedpa", "fedep"))
    assert raw["examples"]["fedpa"] == [3 * 1437] * 2  # every client, 3 epochs, each pass
    ratios = fb.paired_ratios(raw, "fedavg_e3")
    assert set(ratios) == {"fedpa", "fedep"}
    assert ratios["fedpa"][1] == pytest.approx(raw["round_s"]["fedavg_e3"][1] / raw["round_s"]["fedpa"][1])
    results = {"fedpa": {}, "fedep": {}}
    fb.add_paired(results, raw, "fedavg_e3")
    assert results["fedep"][fb.PAIRED_RATIO] == pytest.approx(float(np.median(ratios["fedep"])))
    assert results["fedep"][fb.PAIRED_RATIO + "_range"] == [min(ratios["fedep"]), max(ratios["fedep"])]
    assert fb.paired_groups(fb.resolve_names(["fedpa", "fedep_100"])) == {"fedavg_e3": ["fedavg_e3", "fedpa"], "fedavg_e3_100": ["fedavg_e3_100", "fedep_100"]}
    with pytest.raises(fb.BenchError, match="federated workloads only"):
        fb.measure_paired([fb.REFERENCE, "fedavg"], TINY, rounds=1)
    # In blocks of pipelined rounds: 3 rounds in blocks of 2 are two blocks, per-round averages.
    blocks = fb.measure_paired(["fedavg_e3", "fedep"], TINY, rounds=3, block=2)
    assert [len(blocks["round_s"][n]) for n in ("fedavg_e3", "fedep")] == [2, 2]
    assert blocks["examples"]["fedep"] == [3 * 1437] * 2
    # Ratios are of throughputs: a pass that trains twice the examples in the same time is 2x.
    uneven = {"round_s": {"a": [1.0, 2.0], "b": [1.0, 1.0]}, "examples": {"a": [100, 100], "b": [200, 100]}}
    assert fb.paired_ratios(uneven, "a") == {"b": [2.0, 2.0]}


def test_pinned_limit_processes_start_together_and_report():
    raws = fb.run_limit_processes(fb.WORKLOADS[fb.REFERENCE], TINY)
    assert len(raws) == num_cores()
    assert sum(r["examples"] for r in raws) == 1437
    entry = fb.limit_entry(raws)
    assert _positive_finite(entry["examples_per_s"]) and entry["processes"] == len(raws)


def test_missing_data_and_unknown_workloads_are_clear_errors(tmp_path, monkeypatch):
    missing = "fashion_mnist is not on this machine.*apt-get install dataset-fashion-mnist"
    with pytest.raises(fb.BenchError, match=missing):
        fb.check_dataset(fb.BenchSettings(data_dir=str(tmp_path)))
    with pytest.raises(fb.BenchError, match="unknown workload"):
        fb.resolve_names(["fedsomething"])
    assert fb.resolve_names(["fedavg"]) == [fb.REFERENCE, "fedavg"]
    assert fb.resolve_names(["fedep_100"]) == [fb.REFERENCE, "fedavg_e3_100", "fedep_100"]  # its baseline runs with it
    res = CliRunner().invoke(app, ["bench", "--workload", "fedsomething"])
    assert res.exit_code == 3 and "unknown workload" in res.output
    # This machine as if Fashion-MNIST were not installed ($FEDBAYES_DATA an empty folder, the
    # Debian folder elsewhere): a wrong name is still reported as such, before any data is looked
    # at, and a right one as the missing data.
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(idx.ENV_VAR, str(empty))
    monkeypatch.setattr(idx, "FASHION_MNIST_SYSTEM_DIRS", (str(tmp_path / "no-debian-package"),))
    with pytest.raises(fb.BenchError, match=missing):
        fb.check_dataset(fb.QUICK)
    res = CliRunner().invoke(app, ["bench", "--workload", "fedsomething"])
    assert res.exit_code == 3 and "unknown workload" in res.output and "not on this machine" not in res.output
    res = CliRunner().invoke(app, ["bench", "--quick", "--workload", "fedavg"])
    assert res.exit_code == 3 and "fashion_mnist is not on this machine" in res.output


def test_settings_survive_the_worker_spec_and_algorithms_are_built_by_name():
    spec = json.loads(json.dumps({"settings": fb.settings_to_dict(TINY)}))
    assert fb.settings_from_dict(spec["settings"]) == TINY  # hidden comes back a tuple
    with pytest.raises(fb.BenchError, match="unknown algorithm 'fedsomething'"):
        fb.build_algorithm("fedsomething", None, (), 1, None, "classification")


def test_the_parent_process_imports_no_jax():
    # fedbayes bench sets each worker's XLA flags before JAX starts; the parent must not start it.
    code = "import sys, fedbayes.bench, fedbayes.bench.run; assert 'jax' not in sys.modules, 'jax imported'"
    src = str(Path(fb.__file__).parents[2])  # the fedbayes under test, not another installed one
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr


def test_cli_json_is_one_object_keyed_by_workload(repeat, monkeypatch):
    monkeypatch.setattr(fb, "run_bench", lambda settings, names, **_: fb.summarize([repeat]))
    res = CliRunner().invoke(app, ["bench", "--quick", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out) == set(THROUGHPUT) and {"fedpa", "fedep"} <= set(out)
    assert all(set(REQUIRED) <= set(e) for e in out.values())
    assert all(fb.BASELINE_RATIO in out[k] for k in ("fedpa", "fedep"))


def test_relative_workloads_report_paired_ratios_against_their_reference(capsys, monkeypatch):
    # Every relative measure on tiny sizes: one entry per ratio, with its target and verdict.
    raws = {name: fb.RELATIVE_MEASURES[name](TINY) for name in ("cnn", "vbnn")}
    assert list(raws["cnn"]["ratios"]) == ["cnn round / plain loop"] and raws["cnn"]["examples_per_round"] == 2 * 16
    assert list(raws["vbnn"]["ratios"]) == ["vbnn (gaa) round / cnn fedavg round"]
    # The curvature workload through the worker's entry point (what a bench process runs).
    fb.protocol.worker([json.dumps({"relative": "curvature", "settings": fb.settings_to_dict(TINY)})])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(fb.RESULT_PREFIX)
    raws["curvature"] = json.loads(line[len(fb.RESULT_PREFIX) :])
    assert set(raws["curvature"]["ratios"]) == {"mlp/fisher", "mlp/empirical", "mlp/ggn"}
    results = {name: fb.relative_entry(name, raw) for name, raw in raws.items()}
    for entry in results.values():
        assert entry["kind"] == "relative" and entry["description"] and entry["reps"] == TINY.relative_reps
        for r in entry["ratios"].values():
            assert _positive_finite(r["median"]) and r["min"] <= r["median"] <= r["max"]
            assert r["meets"] == (r["median"] <= r["target"] if r["direction"] == "<=" else r["median"] >= r["target"])
    assert results["curvature"]["ratios"]["mlp/ggn"]["target"] == 11.0 and results["cnn"]["ratios"]["cnn round / plain loop"]["target"] == 0.8
    assert len(fb.relative_rows(results)) == 5 and fb.rows(results) == []
    table = fb.markdown(results)
    assert "| measure |" in table and "| examples/s |" not in table and "mlp/empirical" in table
    # Named alone, relative workloads need neither the limit nor the dataset.
    assert fb.resolve_names(["cnn", "curvature"]) == ["curvature", "cnn"]
    assert fb.resolve_names(["cnn", "fedavg"]) == [fb.REFERENCE, "fedavg", "cnn"]
    monkeypatch.setattr(fb.run, "run_relative_process", lambda name, settings: raws[name])
    monkeypatch.setattr(fb.run, "check_dataset", lambda settings: pytest.fail("relative workloads read no data"))
    assert fb.run_bench(TINY, ["vbnn", "cnn"]) == {n: results[n] for n in ("cnn", "vbnn")}
    monkeypatch.setattr(fb, "run_bench", lambda settings, names, **_: results)
    res = CliRunner().invoke(app, ["bench", "--workload", "cnn"], env={"COLUMNS": "80"})
    # one table, the relative one (no throughput columns), no line wider than the terminal, names and numbers whole
    assert res.exit_code == 0, res.output
    assert len(re.findall(r"\nworkload +measure", res.output)) == 1 and "examples/s" not in res.output and "cnn round / plain loop" in res.output
    assert max(map(len, res.output.splitlines())) <= 80


def test_the_throughput_table_fits_80_columns_leaving_out_columns_with_a_note():
    results = json.loads((ROOT / "docs" / "results" / "bench_2026-11-24.json").read_text())
    text = fb.text_tables(results, title="fedbayes bench", width=80)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    assert all(f"\n{name} " in text for name in results)  # every workload's name whole
    assert "left out to fit 80 columns" in text and "all in --json" in " ".join(text.split())
    assert "examples/s" in lines[1] and "ratio to limit" in lines[1]  # the columns that matter stay


def test_ratio_summary_pairs_repetitions():
    # Per-repetition ratios: a slow repetition of both sides leaves the ratio unchanged.
    r = fb.relative.ratio_summary([1.0, 4.0, 2.0], [2.0, 8.0, 1.0], 0.8, ">=")
    assert (r["median"], r["min"], r["max"], r["meets"]) == (0.5, 0.5, 2.0, False)
    assert fb.relative.ratio_summary([3.0], [1.0], 2.0, "<=")["meets"] is False
    assert fb.relative.ratio_summary([3.0], [1.0], None, "<=")["meets"] is None


def test_paired_rows_pair_each_pass_with_the_reference():
    """A row's ratio is the median of pass-by-pass ratios, not the ratio of medians."""
    times = {"ref": [1.0, 2.0, 4.0], "x": [3.0, 2.0, 8.0]}
    rows = fb.relative.paired_rows(times, "ref")
    assert rows["ref"] == {"ms": 2000.0, "ratio": 1.0, "range": [1.0, 1.0]}
    assert rows["x"]["ms"] == 3000.0
    assert rows["x"]["ratio"] == 2.0 and rows["x"]["range"] == [1.0, 3.0]  # ratios 3, 1, 2; medians' ratio 1.5
    lines = fb.relative.format_rows(rows, " of ref")
    assert lines[1].split() == ["x", "3000.000", "ms", "2.00", "(1.00-3.00)", "of", "ref"]


def test_the_gpu_record_is_its_own_set_without_the_cpu_reference(repeat, monkeypatch):
    gpu_only = {n for n in fb.GPU_WORKLOADS if fb.WORKLOADS[n].gpu}
    assert gpu_only and not gpu_only & set(fb.resolve_names(None))  # the default set shares only cnn and vbnn
    assert fb.REFERENCE not in fb.resolve_names(list(fb.GPU_WORKLOADS))
    assert {"gpu_fedavg_100", "gpu_fedep_10", "gpu_pvi_100", "gpu_fedlap_cov_10", "cnn_100", "vbnn_100"} <= set(fb.GPU_WORKLOADS)
    results = fb.summarize([{"gpu_fedavg_10": repeat["gpu_fedavg_10"]}])
    entry = results["gpu_fedavg_10"]
    assert "ratio_to_limit" not in entry and entry["layout"] == "vmap" and entry["store"] == "device" and entry["device_kind"]
    assert fb.OWN_LIMIT_RATIO in entry and "gpu_fedavg_10" in fb.markdown(results)
    seen = {}
    monkeypatch.setattr(fb, "run_bench", lambda settings, names, **_: seen.update(names=names, settings=settings) or results)
    res = CliRunner().invoke(app, ["bench", "gpu", "--json"])
    assert res.exit_code == 0, res.output
    assert seen["names"] == list(fb.GPU_WORKLOADS) and seen["settings"] == fb.GPU and not seen["settings"].paired


def test_fused_rounds_are_timed_per_block(repeat):
    e = repeat["fedavg_100_fused"]
    assert e["rounds"] == fb.steady_rounds(fb.WORKLOADS["fedavg_100_fused"], TINY) and e["round_s"] > 0
