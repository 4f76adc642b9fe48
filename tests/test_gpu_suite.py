"""benchmarks/gpu_suite.py: its tiny form runs every section on CPU and writes the JSON a GPU run writes."""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from difftx.attention import kernels

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


suite = _load()
CHOICE_KEYS = {"card", "dtype", "d", "T", "mode", "backend", "ratio", "candidates", "source"}


def _broken(q, k, v, lam, mask, scale, return_maps=False):
    """A DIFF 'backend' with the wrong lambda: the suite must mark it failed and leave it out of every timing."""
    return kernels.sdpa(q, k, v, lam * 1.5, mask, scale)


def _run(tmp_path, *extra):
    out = tmp_path / "suite.json"
    assert suite.main(["--tiny", "--device", "cpu", "--out", str(out), "--repeats", "2", "--warmup", "0",
                       "--train-steps", "2", *extra]) == 0
    return json.loads(out.read_text())


def test_tiny_run_writes_every_section(tmp_path, monkeypatch):
    monkeypatch.setitem(kernels.BACKENDS, "broken_for_test", _broken)
    r = _run(tmp_path, "--candidates", "sdpa,auto,broken_for_test", "--shapes", "goal,gqa2", "--train-modes", "eager")
    assert list(r["sections"]) == list(suite.SECTIONS)
    assert all(s["status"] != "error" for s in r["sections"].values()), r["sections"]
    env = r["env"]
    for key in ("card", "torch", "cuda", "cudnn", "triton", "commit", "command", "capability", "memory_gib"):
        assert key in env

    corr = r["correctness"]
    assert corr["passed"]["broken_for_test"] is False and "broken_for_test" in corr["failed"]
    core = [c for c in corr["cases"] if c["kind"] == "core"]
    assert {c["Hkv"] < c["H"] for c in core} == {True, False}  # MHA and GQA
    assert any(c["H"] // c["Hkv"] == 4 for c in core)
    for case in corr["cases"]:
        for row in case["rows"]:
            assert set(row["errors"]) >= ({"out", "dq", "dk", "dv", "dlambda"} if case["kind"] == "core" else
                                          {"out", "dx", "dsubln.weight", "dlambda_q1"})
            if row["candidate"] == "broken_for_test":
                assert not row["passed"] and row["errors"]["out"] > suite.TOLERANCE
    # checked until it fails once, then no more
    assert [c["not_run"] for c in corr["cases"]] == [[]] + [["broken_for_test"]] * (len(corr["cases"]) - 1)

    shapes = r["attention"]["shapes"]
    assert [s["shape"] for s in shapes] == ["goal", "gqa2"]
    for s in shapes:
        names = {row["name"] for row in s["rows"]}
        assert "diff/broken_for_test" not in names
        assert s["excluded"]["diff/broken_for_test"] == "failed correctness"
        assert "baseline/sdpa" in names and set(s["reference"]) == set(suite.MODES)
        for row in s["rows"]:
            assert set(row["modes"]) == set(suite.MODES) and row["kernels"]
            for m in row["modes"].values():
                assert m["ms"] > 0 and m["reps"] == 2 and m["ratio"] > 0 and m["tflops_useful"] > 0

    assert r["choices"], "the MHA shape gives auto's entries"
    for c in r["choices"]:
        assert set(c) == CHOICE_KEYS and c["mode"] in ("train", "infer") and c["dtype"] == "bfloat16"
        assert c["backend"] in c["candidates"] and c["ratio"] == c["candidates"][c["backend"]]
        assert "auto" not in c["candidates"] and "broken_for_test" not in c["candidates"]
    from difftx.attention import gpu_table

    assert len(gpu_table.parse(r, "suite.json")) == len(r["choices"])  # the table's reader takes them

    runs = r["training"]["runs"]
    assert [(x["size"], x["mode"]) for x in runs] == [("test", "eager"), ("test-d2x", "eager")]
    for x in runs:
        assert x["status"] == "done" and x["paired_ratio"]["rounds"] == 2
        assert set(x["profile"]["diff"]["ms_by_category"]) == {c for c, _ in suite.CATEGORIES} | {"other"}
    assert {(x["batch"], x["T"]) for x in r["decode"]["rows"]} == {(1, 16), (1, 32), (2, 16), (2, 32)}
    goals = {g["goal"]: g for g in r["goals"]}
    assert len(goals) == 6 and all(g["verdict"] in ("met", "met (stretch too)", "not met", "not measured")
                                   for g in goals.values())
    assert next(g for g in r["goals"] if g["goal"].startswith("correctness"))["verdict"] == "not met"


def _grad_only(q, k, v, lam, mask, scale, return_maps=False):
    """A DIFF 'backend' whose forward without gradients fails (on a GPU: another compile, autotuner key or graph)."""
    if not torch.is_grad_enabled():
        raise RuntimeError("no kernel for the forward alone")
    return kernels.sdpa(q, k, v, lam, mask, scale)


def test_a_candidate_whose_forward_alone_fails_is_excluded_before_the_timings(tmp_path, monkeypatch):
    """Each arm's first calls run the forward without gradients too: what compiles or tunes there does so outside
    the timed rounds, and a candidate that fails there is excluded instead of ending the shape in its fwd mode."""
    monkeypatch.setitem(kernels.BACKENDS, "grad_only_for_test", _grad_only)
    r = _run(tmp_path, "--sections", "attention", "--candidates", "sdpa_pad,grad_only_for_test", "--shapes", "goal")
    assert r["correctness"]["passed"]["grad_only_for_test"] is True  # checked with gradients only
    shape = r["attention"]["shapes"][0]
    assert shape["status"] == "done", shape.get("error")
    assert "no kernel for the forward alone" in shape["excluded"]["diff/grad_only_for_test"]
    rows = {row["name"]: row for row in shape["rows"]}
    assert "diff/grad_only_for_test" not in rows and set(rows["diff/sdpa_pad"]["modes"]) == set(suite.MODES)


def test_the_triton_autotuner_choices_are_recorded(tmp_path, monkeypatch):
    tk = pytest.importorskip("difftx.attention.triton_kernel")
    chosen = [{"kernel": "fwd", "key": ["128", "4096"], "config": {"BLOCK_M": 64, "num_warps": 8},
               "timings_ms": {"a": 1.0}}]
    monkeypatch.setattr(tk, "autotune_report", lambda: chosen)
    r = _run(tmp_path, "--sections", "attention", "--candidates", "sdpa_pad", "--shapes", "goal")
    assert r["attention"]["triton_autotune"] == chosen


def test_each_shape_and_case_compiles_its_own_graphs(tmp_path, monkeypatch):
    """Dynamo's graphs are dropped before every attention shape and correctness case, so the compiled flex never
    reaches the recompile limit (past it, flex would run and be timed in its unfused form)."""
    seen = []
    real = suite.run_shape
    monkeypatch.setattr(suite, "fresh_graphs", lambda: seen.append("reset"))
    monkeypatch.setattr(suite, "run_shape", lambda s_, shape, *a: (seen.append(shape.name), real(s_, shape, *a))[1])
    r = _run(tmp_path, "--candidates", "sdpa", "--shapes", "goal,d64", "--sections", "correctness,attention")
    cases = len(r["correctness"]["cases"])
    assert seen == ["reset"] * cases + ["reset", "goal", "reset", "d64"]


def test_failing_section_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    def boom(s, deadline):
        raise RuntimeError("a section that fails")

    monkeypatch.setitem(suite.RUNNERS, "decode", boom)
    r = _run(tmp_path, "--sections", "decode")
    assert list(r["sections"]) == ["env", "decode", "goals"]
    decode = r["sections"]["decode"]
    assert decode["status"] == "error" and "a section that fails" in decode["traceback"]
    assert {g["verdict"] for g in r["goals"]} == {"not measured"}


def test_a_failing_training_run_is_recorded(tmp_path, monkeypatch):
    import train_throughput  # on the path beside gpu_suite

    def boom(*args, **kwargs):
        raise RuntimeError("a step that fails")

    monkeypatch.setattr(train_throughput, "_step", boom)
    r = _run(tmp_path, "--sections", "training", "--train-modes", "eager")
    runs = r["training"]["runs"]
    assert [(x["size"], x["status"]) for x in runs] == [("test", "error"), ("test-d2x", "error")]
    assert "a step that fails" in runs[0]["traceback"] and r["sections"]["training"]["status"] == "partial"


def test_decode_steps_that_did_not_run_are_recorded(tmp_path, monkeypatch):
    """A DIFF step that bench_decode leaves out (its first call failed: on a GPU, e.g. its compile) and an ordinary
    step that raises (e.g. out of memory) are error rows; the other rows and the later batches still run."""
    import difftx.bench as bench

    real = bench.bench_decode

    def flaky(**kw):
        if kw["batch"] == 2 and "steps" not in kw:
            raise RuntimeError("CUDA out of memory")
        return [r for r in real(**kw) if r.name != "diff/auto static"]

    monkeypatch.setattr(bench, "bench_decode", flaky)
    r = _run(tmp_path, "--sections", "decode")
    assert r["sections"]["decode"]["status"] == "partial"
    rows = r["decode"]["rows"]
    assert [(x["batch"], x["status"]) for x in rows] == [(1, "done"), (1, "done"), (2, "error")]
    assert "CUDA out of memory" in rows[-1]["error"]
    assert [(x["batch"], x["T"], x["status"]) for x in r["decode"]["static_rows"]] == \
        [(b, T, "error: diff/static did not run") for b in (1, 2) for T in (32, 16)]  # the longest first


def test_a_spent_budget_skips_and_says_so(tmp_path, monkeypatch):
    """A run whose time is spent (the clock says so from the start: no race with how fast the machine is)."""
    monkeypatch.setattr(suite.Budget, "left", lambda self: 0.0)
    r = _run(tmp_path, "--budget-s", "0.01", "--sections", "attention,decode", "--candidates", "sdpa")
    shapes = r["attention"]["shapes"]
    assert [s["status"] for s in shapes] == ["skipped: budget"] * len(suite.attention_shapes(True))
    assert r["sections"]["decode"]["status"] == "partial: budget"
    assert all(row["status"] == "skipped: budget" for row in r["decode"]["rows"])


FAULTS = """
import os

import torch

from difftx.attention import kernels


def dies(q, k, v, lam, mask, scale, return_maps=False):  # a process killed by its fault (a signal, an abort)
    os._exit(70)


def poisons(q, k, v, lam, mask, scale, return_maps=False):  # a fault that leaves the CUDA context unusable
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def dies_when_profiled(q, k, v, lam, mask, scale, return_maps=False):  # a fault after its first calls
    if torch.autograd._profiler_enabled():
        os._exit(71)
    return kernels.sdpa(q, k, v, lam, mask, scale)


kernels.register_backend("dies_for_test", dies)
kernels.register_backend("poisons_for_test", poisons)
kernels.register_backend("dies_when_profiled_for_test", dies_when_profiled)
"""


def _nan(q, k, v, lam, mask, scale, return_maps=False):
    return kernels.sdpa(q, k, v, lam, mask, scale) * float("nan")


def test_a_candidate_that_gives_nan_fails_and_the_json_stays_strict(tmp_path, monkeypatch):
    monkeypatch.setitem(kernels.BACKENDS, "nan_for_test", _nan)
    out = tmp_path / "suite.json"
    assert suite.main(["--tiny", "--device", "cpu", "--out", str(out), "--sections", "correctness",
                       "--candidates", "sdpa_pad,nan_for_test"]) == 0

    def refuse(constant):
        raise AssertionError(f"{constant} in the JSON")

    r = json.loads(out.read_text(), parse_constant=refuse)
    assert r["correctness"]["passed"] == {"sdpa_pad": True, "nan_for_test": False}
    assert r["correctness"]["cases"][0]["rows"][1]["errors"]["out"] is None and r["null_reasons"]


def _isolated(tmp_path, monkeypatch, *extra):
    for name in ("dies_for_test", "poisons_for_test", "dies_when_profiled_for_test"):  # unregistered after the test
        monkeypatch.setitem(kernels.BACKENDS, name, None)
    faults = tmp_path / "faults.py"
    faults.write_text(FAULTS)
    return _run(tmp_path, "--isolate", "yes", "--register", str(faults), "--sections", "correctness,attention",
                *extra)


def test_a_section_whose_process_ends_restarts_without_the_arm_that_ended_it(tmp_path, monkeypatch):
    """Each section in its own process: a candidate that kills its process, and one whose error leaves the CUDA
    context unusable, are each left out and the section restarted; the rest is measured as in one process."""
    r = _isolated(tmp_path, monkeypatch, "--candidates", "sdpa_pad,dies_for_test,poisons_for_test", "--shapes", "goal")
    assert [(c["section"], c["exit"], c.get("left_out")) for c in r["crashes"]] == [
        ("correctness", 70, "diff/dies_for_test"), ("correctness", suite.EXIT_CONTEXT_LOST, "diff/poisons_for_test")]
    assert "illegal memory access" in r["crashes"][1]["why"] and r["crashes"][0]["running"]["case"] == "mha-33"
    assert set(r["crashed"]) == {"diff/dies_for_test", "diff/poisons_for_test"}
    assert "running" not in r and "lost" not in r
    assert {k: v["status"] for k, v in r["sections"].items()} == {
        "env": "done", "correctness": "done", "attention": "done", "goals": "done"}
    corr = r["correctness"]
    assert corr["passed"] == {"sdpa_pad": True, "dies_for_test": False, "poisons_for_test": False}
    assert set(corr["crashed"]) == {"dies_for_test", "poisons_for_test"} and corr["not_checked"] == []
    shape = r["attention"]["shapes"][0]
    assert shape["status"] == "done" and {row["name"] for row in shape["rows"]} >= {"diff/sdpa_pad", "baseline/sdpa"}
    for name in ("diff/dies_for_test", "diff/poisons_for_test"):
        assert shape["excluded"][name].startswith("ended its process")
    assert "--child" not in r["env"]["command"] and "--isolate" in r["env"]["command"]


def test_a_process_that_ends_with_no_arm_to_blame_goes_on_from_the_next_shape(tmp_path, monkeypatch):
    r = _isolated(tmp_path, monkeypatch, "--candidates", "dies_when_profiled_for_test", "--shapes", "goal,d64")
    assert r["correctness"]["passed"] == {"dies_when_profiled_for_test": True}  # no profiler there
    assert [(c["exit"], c["running"].get("shape"), c["running"].get("arm")) for c in r["crashes"]] == [
        (71, "goal", None), (71, "d64", None)]
    shapes = r["attention"]["shapes"]
    assert [(x["shape"], x["status"]) for x in shapes] == [("goal", "error"), ("d64", "error")]
    assert all("exit code 71" in x["error"] for x in shapes) and r["sections"]["attention"]["status"] == "partial"
    assert r["crashed"] == {} and r["sections"]["goals"]["status"] == "done"


def test_a_section_killed_past_its_deadline_ends_and_its_arm_is_left_out_of_the_later_ones(tmp_path, monkeypatch):
    """The parent's side of a hang, from a deterministic stand-in for the section's process: it says what runs,
    then the wait for it runs out (subprocess.run kills the process and raises)."""
    out = tmp_path / "suite.json"
    seen = []

    def fake_process(cmd, env, timeout):
        section = cmd[cmd.index("--child") + 1]
        seen.append((section, timeout))
        r = json.loads(out.read_text())
        if section == "correctness":
            r["running"] = {"section": section, "arm": "diff/sdpa_pad", "case": "mha-33"}
            out.write_text(json.dumps(r))
            return None  # killed past its deadline
        r["sections"][section] = {"status": "done"}
        out.write_text(json.dumps(r))
        return 0

    monkeypatch.setattr(suite, "run_child", fake_process)
    r = _run(tmp_path, "--isolate", "yes", "--sections", "correctness,attention", "--candidates", "sdpa_pad")
    assert [s for s, _ in seen] == ["env", "correctness", "attention"]  # killed: not restarted
    assert all(t >= suite.GRACE_S for _, t in seen)
    assert r["crashes"] == [{"section": "correctness", "exit": None, "left_out": "diff/sdpa_pad",
                             "running": {"section": "correctness", "arm": "diff/sdpa_pad", "case": "mha-33"},
                             "why": f"it was still running {suite.GRACE_S:.0f} s past its deadline and was killed"}]
    assert r["crashed"] == {"diff/sdpa_pad": r["crashes"][0]["why"]}
    assert r["sections"]["correctness"]["status"] == "error" and "case mha-33" in r["sections"]["correctness"]["error"]
    assert r["sections"]["attention"]["status"] == "done" and "running" not in r


def test_a_section_process_still_running_is_killed_with_what_it_started(tmp_path, monkeypatch):
    """run_child kills the whole session of a process past its time: here a shell and the sleep it started. The
    wait starts only once the shell has said (through a FIFO) that the sleep runs: no race with the machine."""
    fifo = tmp_path / "ready"
    os.mkfifo(fifo)
    real_popen = suite.subprocess.Popen

    def popen_when_ready(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        with open(fifo) as f:  # blocks until the shell has written its sleep's pid
            popen_when_ready.pid = int(f.read())
        return proc

    monkeypatch.setattr(suite.subprocess, "Popen", popen_when_ready)
    assert suite.run_child(["bash", "-c", f"sleep 300 & echo $! > {fifo}; wait"], dict(os.environ), 0.2) is None
    stat = Path(f"/proc/{popen_when_ready.pid}/stat")
    deadline = time.monotonic() + 30
    while stat.exists() and stat.read_text().split()[2] != "Z":  # killed; gone once reaped
        assert time.monotonic() < deadline, "the process the section's process started is still running"
        time.sleep(0.05)
    monkeypatch.setattr(suite.subprocess, "Popen", real_popen)
    assert suite.run_child([sys.executable, "-c", "import sys; sys.exit(5)"], dict(os.environ), 30.0) == 5


def test_context_errors_and_the_user_command():
    cpu = torch.device("cpu")
    assert suite.context_lost(RuntimeError("CUDA error: unspecified launch failure"), cpu)
    assert suite.context_lost(RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"), cpu)
    assert not suite.context_lost(RuntimeError("No available kernel. Aborting execution."), cpu)
    assert not suite.context_lost(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), cpu)
    assert suite.user_argv(["--tiny", "--child", "attention", "--deadline=-inf", "--out", "x"]) == \
        ["--tiny", "--out", "x"]
    assert suite.user_argv(["--deadline", "12.5", "--shapes", "goal"]) == ["--shapes", "goal"]


def test_bad_arguments_are_refused(tmp_path, capsys):
    (tmp_path / "broken.py").write_text("raise RuntimeError('a registered file that fails')\n")
    for args in (["--register", str(tmp_path / "broken.py")], ["--sections", "nope"], ["--shapes", "nope"],
                 ["--candidates", "nope"], ["--repeats", "0"],
                 ["--budget-s", "0"], ["--register", str(tmp_path / "missing.py")], ["--register", "no_such_module_x"],
                 ["--train-modes", "jit"]):
        with pytest.raises(SystemExit) as e:
            suite.main(["--tiny", "--out", str(tmp_path / "x.json"), *args])
        assert e.value.code == 2
        assert args[0] in capsys.readouterr().err
    assert suite.parse_sections("attention") == ["env", "correctness", "attention", "goals"]
    assert [s.name for s in suite.select_shapes(suite.attention_shapes(False), "gqa,sweep-16k")] == \
        ["gqa2", "gqa4", "sweep-16k"]


def test_cuda_trace_attribution_and_step_breakdown():
    """The profiler readers on a CUDA-shaped trace (the GPU path, which CPU runs cannot reach)."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": "gpu_suite::a", "ts": 0, "dur": 100},
          {"ph": "X", "cat": "user_annotation", "name": "gpu_suite::b", "ts": 100, "dur": 100},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 2,
           "args": {"correlation": 1}},
          {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 110, "dur": 2, "args": {"correlation": 2}},
          # a kernel launched in a's range may run after it ends: attributed by its launch
          {"ph": "X", "cat": "kernel", "name": "pytorch_flash::flash_fwd_kernel", "ts": 95, "dur": 20,
           "args": {"correlation": 1}},
          {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 130, "dur": 30, "args": {"correlation": 2}},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 170, "dur": 10, "args": {}}]
    got = suite.kernels_by_label(ev, ["gpu_suite::a", "gpu_suite::b"], "cuda")
    assert got == {"gpu_suite::a": ["pytorch_flash::flash_fwd_kernel"],
                   "gpu_suite::b": ["sm90_xmma_gemm_bf16", "Memcpy DtoD"]}
    step = suite.step_breakdown(ev, "gpu_suite::b", "cuda")
    assert step["wall_ms"] == pytest.approx(0.1)
    cats = step["ms_by_category"]
    assert cats["attention core"] == pytest.approx(0.015)  # clipped to the step's range
    assert cats["matrix products"] == pytest.approx(0.03) and cats["copies"] == pytest.approx(0.01)
    assert step["busy_ms"] == pytest.approx(0.055) and step["idle_fraction"] == pytest.approx(0.45)


def test_the_reference_is_the_fastest_baseline_even_when_its_kernel_names_look_odd():
    rows = {"baseline/sdpa": {"kind": "baseline"}, "baseline/cudnn": {"kind": "baseline", "fallback_suspected": True},
            "diff/triton": {"kind": "diff"}}
    assert suite.fastest_baseline(rows, {"baseline/sdpa": 2.0, "baseline/cudnn": 1.0, "diff/triton": 0.5}) == \
        "baseline/cudnn"
    assert suite.fastest_baseline(rows, {"diff/triton": 0.5}) is None


def test_a_backwards_peak_memory_leaves_its_forward_out(monkeypatch):
    """bwd's peak is measured around the backward alone: its forward (the untimed part) runs before."""
    calls = []
    arm = suite.Arm("a", "diff", lambda x: (calls.append("forward"), x * 2)[1],
                    (torch.ones(3, requires_grad=True),), torch.ones(3))

    def measured(fn, device):
        calls.append("measure")
        fn()
        return 1.0

    monkeypatch.setattr("difftx.bench.peak_memory_mib", measured)
    cuda = torch.device("cuda")  # the device object alone: nothing runs on it
    assert suite.peak_mib(arm, "bwd", cuda) == 1.0 and calls == ["forward", "measure"]
    assert arm.inputs[0].grad is None  # cleaned up
    calls.clear()
    assert suite.peak_mib(arm, "fwd+bwd", cuda) == 1.0 and calls == ["measure", "forward"]
    assert suite.peak_mib(arm, "bwd", torch.device("cpu")) is None


def test_flop_units_and_verdicts():
    s = suite.Shape("x", 2, 8, 3, 3, 4)
    assert suite.unit_flops(s) == 2 * 2 * 6 * 32 * 4
    assert suite.mode_units(suite.USEFUL_PRODUCTS, "fwd+bwd") / suite.mode_units(suite.BASELINE_PRODUCTS,
                                                                                 "fwd+bwd") == pytest.approx(8 / 7)
    assert suite._verdict(1.5, 2.0, 1.6, True) == "met (stretch too)"
    assert suite._verdict(0.91, 0.90, 0.93, False) == "met"
    assert suite._verdict(None, 1.0, None, True) == "not measured"
    assert suite.peak_tflops("NVIDIA H100 80GB HBM3") == 989 and suite.peak_tflops("NVIDIA H100 PCIe") == 756
    assert suite.peak_tflops("NVIDIA H200") == 989 and suite.peak_tflops("NVIDIA H200 NVL") == 835
    assert suite.peak_tflops("cpu") is None


@pytest.mark.skipif(not os.environ.get("DIFFTX_TEST_COMPILE"),
                    reason="torch.compile of two models takes ~10 s on 2 CPU cores; set DIFFTX_TEST_COMPILE=1 to run")
def test_tiny_compiled_training(tmp_path):
    r = _run(tmp_path, "--sections", "training", "--compile-backend", "eager")
    runs = {(x["size"], x["mode"]): x for x in r["training"]["runs"]}
    assert runs[("test", "compiled")]["status"] == "done" and set(runs[("test", "compiled")]["compile_s"]) == \
        {"diff", "baseline"}
    torch._dynamo.reset()
