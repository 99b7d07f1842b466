"""The GPU sections of the benchmarks, dry-run on CPU with tiny shapes: bench/gpu_check.sh runs
them only where a GPU is lent, so CI checks their code paths here (timings are not checked)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
TINY_HF = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)


def test_rollout_gpu_section_runs_on_cpu_with_profile(monkeypatch):
    # appended, not prepended: bench/weights_sync.py must not shadow the weights_sync package
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    import rollout_vs_hf
    with torch.no_grad():
        out = rollout_vs_hf.gpu_section(1, device="cpu", shape=TINY_HF, B=4, P=8, new=8,
                                        hf_static=False, profile=True)
    assert out["ours_eager"]["new_tokens"] == out["hf_dynamic_cache"]["new_tokens"] == 4 * 8
    assert out["speedup_vs_best_hf"] > 0
    prof = out["profile"]["ours_eager"]
    assert prof["top"] and all(r["calls"] >= 1 for r in prof["top"])
    assert prof["kernels_per_step"] > 0 and prof["ms_per_step"] > 0
    host = prof["host"]  # the engine's phases, labelled only while profiled
    assert host["decode"]["calls"] == 7 and host["prefill"]["calls"] >= 1
    assert host["start_samples"]["calls"] >= 1 and host["decode"]["host_ms"] > 0


def test_rollout_modes_flags_reach_the_engines(monkeypatch):
    """`--modes` flags as Engine arguments: sync64 reads the finished flags every 64 steps (the
    harvest's A/B on the GPU), qkvonly stacks q|k|v only, and an unknown flag is not a mode."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    import rollout_vs_hf
    from model import ModelArgs, Transformer
    model = Transformer(ModelArgs()).eval()
    engines = rollout_vs_hf.engines_by_mode(model, ["eager", "compile::sync64", "compile::qkvonly"],
                                            "cpu", num_slots=4, max_len=32)
    assert sorted(engines) == ["ours_compile__qkvonly", "ours_compile__sync64", "ours_eager"]
    assert [engines[k].sync_every for k in sorted(engines)] == [1, 64, 1]
    assert engines["ours_compile__qkvonly"].stacked_weights.gate_up is None
    assert engines["ours_compile__sync64"].stacked_weights.gate_up is not None
    assert rollout_vs_hf.valid_mode("compile:flex:sync64:qkvonly")
    assert not rollout_vs_hf.valid_mode("compile:flex:sync8")


@pytest.mark.slow
def test_train_step_gpu_section_runs_on_cpu():
    proc = subprocess.run([sys.executable, str(BENCH / "train_step.py"), "--no-cpu", "--gpu",
                           "--gpu-device", "cpu", "--gpu-shape", "tiny", "--gpu-batch", "2",
                           "--gpu-seq", "32", "--iters", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gpu = json.loads(proc.stdout.strip().splitlines()[-1])["gpu"]
    assert gpu["ours"]["loss_first"] == pytest.approx(gpu["hf"]["loss_first"], rel=1e-2)


def test_plan_vs_measured_keeps_each_layouts_fastest_pass(monkeypatch):
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    from plan_vs_measured import fastest
    runs = [{"step_s": 0.12, "wait_s": 0.02}, {"error": "rank 1 died"}, {"step_s": 0.09, "wait_s": 0.01}]
    assert fastest(runs) == {"step_s": 0.09, "wait_s": 0.01, "passes": [0.12, 0.09]}
    assert fastest([{"error": "a"}, {"error": "b"}]) == {"error": "b"}


def test_random_model_takes_a_real_architecture(tmp_path):
    """make_random_model(shape=...) builds a preset's architecture (as gpu_check.sh's RL run does
    with SmolLM2-135M's) around the task tokenizer, whose ids are a prefix of the vocabulary."""
    from launch.plan import PRESETS
    from model import load_pretrained
    from tools.make_tiny_model import make_random_model
    shape = dict(PRESETS["smollm2-135m"], num_layers=1, vocab_size=300)  # small enough for CI
    model = load_pretrained(make_random_model(tmp_path / "m", shape=shape))
    a = model.args
    assert (a.vocab_size, a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads,
            a.num_layers, a.tie_word_embeddings) == (300, 576, 1536, 9, 3, 1, True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="vocab_size=5 is below"):
        make_random_model(tmp_path / "small", shape={"vocab_size": 5})


def test_vs_trl_compute_floor_by_hand(monkeypatch, tmp_path):
    """The ceiling vs_trl prints beside its ratios: matmul FLOPs of a step, counted by hand."""
    from types import SimpleNamespace

    from model import load_model_args
    from tools.make_tiny_model import make_random_model
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    import vs_trl
    model = make_random_model(tmp_path / "m", hidden=32, layers=2)  # 4 heads, 2 kv heads of 8
    V = load_model_args(model).vocab_size
    per_layer = 32 * 32 + 2 * (16 * 32) + 32 * 32 + 3 * (64 * 32)  # q, k, v, o, gate, up, down
    weights = 2 * per_layer + V * 32  # + lm_head
    a = SimpleNamespace(num_prompts=8, prompts=2, samples=3, new_tokens=5)
    work = vs_trl.step_work(model, a)
    p = work["prompt_tokens_mean"]
    assert work["linear_weights"] == weights
    assert 3 <= p <= 12  # "a+b=" style prompts of one-digit addition, BOS included
    assert work["train_flops"] == pytest.approx(6 * weights * 6 * (p + 5))  # 6 samples
    assert work["gen_flops"] == pytest.approx(2 * weights * (2 * p + 6 * 5))  # prompts once
    w = {"gen_flops": 1.0, "train_flops": 4.0}
    assert vs_trl.step_floor(w, 2.0, world=2, cores=2) == 2.0  # the trainer's 4 on one core
    assert vs_trl.step_floor(w, 1.0, world=3, cores=2) == 2.5  # 5 on two shared cores
    assert vs_trl.step_floor(w, 1.0, world=3, cores=4) == 2.0  # two trainers, a core each


def test_vs_trl_overlap_ceiling_by_hand(monkeypatch, capsys):
    """The overlap ceiling: TRL's time for tandem's samples per step over the longer side of the
    best synchronous run (T_async = max(T_gen, T_train)), and async against its sync run."""
    from types import SimpleNamespace
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    import vs_trl
    syncs = [{"step_s": 0.50, "t_gen_s": 0.30, "t_train_s": 0.20},   # max 0.30
             {"step_s": 0.45, "t_gen_s": 0.21, "t_train_s": 0.24}]   # max 0.24: the best
    assert vs_trl.overlap_step(syncs) == 0.24

    def run(step_s, **extra):
        return {"tokens_per_s": 16 * 32 / step_s, "samples_per_s": 16 / step_s, "step_s": step_s,
                "step_s_median": step_s, "tokens_per_sample": 32.0, "samples_per_step": 16,
                **extra}
    runs = {"trl_t2": [run(0.60)],
            "tandem_w2": [run(0.32, sync=syncs[0]), run(0.30, sync=syncs[1])]}
    a = SimpleNamespace(prompts=4, samples=4, new_tokens=32, rounds=2)
    out = vs_trl.summarise(runs, {}, a, ["trl_t2", "tandem_w2"], {"tandem_w2": 0.15})
    assert out["ratio_tokens_w2"] == pytest.approx(0.60 / 0.30)
    assert out["ceiling_w2"] == pytest.approx(0.60 / 0.15)
    assert out["overlap_ceiling_w2"] == pytest.approx(0.60 / 0.24)
    assert out["async_vs_sync_w2"] == pytest.approx(0.45 / 0.30)  # best sync over best async
    assert "overlap ceiling 2.50x" in capsys.readouterr().out
    del runs["tandem_w2"][0]["sync"], runs["tandem_w2"][1]["sync"]  # --no-overlap-bound
    assert "overlap_ceiling_w2" not in vs_trl.summarise(runs, {}, a, ["trl_t2", "tandem_w2"],
                                                        {"tandem_w2": 0.15})


def test_vs_trl_a_failed_sync_run_keeps_the_async_result(monkeypatch, tmp_path):
    """The sync run only feeds the overlap ceiling: when it fails, the async run still counts."""
    from types import SimpleNamespace
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    import vs_trl

    def run_tandem(model, run_dir, world, bf16, a, eta=1):
        if eta == 0:
            raise RuntimeError("tandem world=2 eta=0 failed (rc 1): boom\nmore")
        return {"step_s": 0.3}
    monkeypatch.setattr(vs_trl, "run_tandem", run_tandem)
    a = SimpleNamespace(overlap_bound=True)
    r, desc = vs_trl._run_side("tandem_w2", 2, False, "tiny", "m", tmp_path, 1, a)
    assert r == {"step_s": 0.3, "sync_error": "tandem world=2 eta=0 failed (rc 1): boom"}
    assert desc == "tandem 1 gen + 1 train, fp32"


@pytest.mark.parametrize("sequential", [False, True])
def test_rollout_measure_reports_a_failed_variant_and_keeps_the_others(monkeypatch, sequential):
    """gpu_check's run measures variants one after the other (sequential): a variant whose
    warm-up raises (a compile error, say) is reported as failed, the others are timed."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    import rollout_vs_hf

    def broken():
        raise RuntimeError("no kernel for this shape")

    res: dict = {}
    rollout_vs_hf.measure({"ours_a": lambda: 7, "ours_bad": broken, "ours_b": lambda: 5}, "cpu",
                          2, res, sequential=sequential)
    assert res["ours_bad"] == {"failed": "RuntimeError: no kernel for this shape"}
    assert res["ours_a"]["new_tokens"] == 7 and len(res["ours_a"]["all_seconds"]) == 2
    assert res["ours_b"]["new_tokens"] == 5


def test_device_timeline_hand_computed(monkeypatch):
    """Busy and idle time of kernel spans (us): overlap counted once, a 100 us gap is a stall
    (the host), a 10 us one launch latency."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    import rollout_vs_hf
    t = rollout_vs_hf.device_timeline([(0, 20), (10, 30), (40, 50), (150, 160)])
    assert t == {"span_ms": 0.16, "busy_ms": 0.05, "idle_ms": 0.11, "stall_ms": 0.1, "stalls": 1}


def test_host_phases_put_each_stall_on_the_host_work_it_overlaps(monkeypatch):
    """Kernel spans (us) with stalls 30-130 and 140-200 (the 5 us gap is launch latency): the
    harvest (20-100) overlaps 70 us of the first, the decode (100-150) 30 + 10, the rest (the
    first stall's 110-130 is within decode's 100-150: 0; 150-200 outside every phase) is other."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    import rollout_vs_hf
    spans = [(0, 30), (130, 135), (140, 140), (200, 210)]
    phases = [("engine.harvest", 20, 100), ("engine.decode", 100, 150),
              ("engine.decode", 205, 208)]
    h = rollout_vs_hf.host_phases(phases, spans)
    assert h == {"harvest": {"calls": 1, "host_ms": 0.08, "stall_ms": 0.07},
                 "decode": {"calls": 2, "host_ms": 0.053, "stall_ms": 0.04},
                 "other": {"calls": 0, "host_ms": 0.0, "stall_ms": 0.05}}
    assert rollout_vs_hf.host_phases(phases, []) == {  # CPU: no kernel spans, host time only
        "harvest": {"calls": 1, "host_ms": 0.08, "stall_ms": 0.0},
        "decode": {"calls": 2, "host_ms": 0.053, "stall_ms": 0.0}}


def test_engine_phases_label_an_engine_only_inside_the_block(monkeypatch):
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    import rollout_vs_hf
    from model import ModelArgs, Transformer
    from rollout.engine import Engine
    from torch.profiler import profile
    model = Transformer(ModelArgs(vocab_size=31, hidden_size=16, intermediate_size=24,
                                  num_layers=1, num_heads=2, num_kv_heads=1))
    model.init_weights(seed=0)
    engine = Engine(model, num_slots=2, max_len=32)
    with rollout_vs_hf.engine_phases(engine), profile() as prof:
        rollout_vs_hf.run_ours(engine, [[1, 2, 3], [4, 5]], 4)
    names = [e.name for e in prof.events() if e.name.startswith("engine.")]
    assert names.count("engine.decode") == engine.stats.decode_steps == 3  # + the first token
    assert not vars(engine).keys() & set(rollout_vs_hf.PHASE_METHODS)  # the class's again


def test_logprob_mismatch_pairs_each_generator_dtype_with_each_trainer_precision(capsys):
    """The fp32 pair is the engine's log-prob parity through the trainer's own packing (shared
    prompts) at temperature != 1; a bf16 side differs by bf16 rounding, not by more."""
    from bench.logprob_mismatch import main
    out = main(["--random", "--threads", "1", "--prompts", "3", "--n", "2", "--new-tokens", "12",
                "--temperature", "0.7"])["results"]
    assert len(out) == 6 and {r["tokens"] for r in out.values()} == {3 * 2 * 12}
    exact = out["gen_float32/train_fp32"]
    assert exact["max_abs"] <= 1e-5 and abs(exact["is_ratio_mean"] - 1) <= 1e-5
    for name, r in out.items():
        if name != "gen_float32/train_fp32":
            assert 1e-5 < r["max_abs"] < 0.1, (name, r)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["bench"] == "logprob_mismatch"


@pytest.mark.parametrize("env,words", [
    ({"SECTIONS": "a b2"}, "unknown section 'b2'"),  # a retired section was skipped silently
    ({"PY": "false"}, "cannot import torch"),  # was reported as "no CUDA device" and exit 0
])
def test_gpu_check_refuses_what_would_skip_its_checks_unseen(env, words):
    import os
    proc = subprocess.run(["bash", str(BENCH / "gpu_check.sh")], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)
    assert proc.returncode == 2 and words in proc.stderr, proc.stdout + proc.stderr


def test_rollout_gpu_section_keeps_its_results_when_a_side_fails(monkeypatch):
    """A failed side is reported as failed and the others' numbers stay: max() over no HF
    result crashed the section, losing what it had measured (and its JSON line)."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    import rollout_vs_hf

    def broken(*a, **k):
        raise RuntimeError("HF failed")
    monkeypatch.setattr(rollout_vs_hf, "run_hf", broken)
    with torch.no_grad():
        out = rollout_vs_hf.gpu_section(1, device="cpu", shape=TINY_HF, B=2, P=4, new=4,
                                        hf_static=False)
    assert "failed" in out["hf_dynamic_cache"] and out["ours_eager"]["new_tokens"] == 2 * 4
    assert "speedup_vs_best_hf" not in out


def test_plan_vs_measured_reads_its_preset_from_any_directory(monkeypatch, tmp_path):
    """The prompt length the model is priced at comes from configs/tiny_cpu.toml, which was
    read relative to the working directory: run from elsewhere, the bench died there."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    from plan_vs_measured import prompt_len
    from tools.make_tiny_model import make_random_model
    model = make_random_model(tmp_path / "m", hidden=32, layers=1)
    monkeypatch.chdir(tmp_path)
    assert prompt_len(str(model)) == 5  # BOS + "a+b=" of the preset's one-digit sums


def test_plan_vs_measured_refuses_a_warmup_that_leaves_no_timed_step(monkeypatch, capsys):
    """Refused before the profile and the runs: the first layout's empty rows crashed the bench
    (IndexError) after minutes of work."""
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    import plan_vs_measured

    def started(*a, **k):
        raise AssertionError("the bench started its work")
    monkeypatch.setattr(plan_vs_measured, "make_random_model", started)
    with pytest.raises(SystemExit) as e:
        plan_vs_measured.main(["--steps", "4", "--warmup", "4"])
    assert e.value.code == 2 and "--warmup 4" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is missing")
def test_logprob_mismatch_names_a_missing_cuda_device(capsys):
    from bench.logprob_mismatch import main
    with pytest.raises(SystemExit) as e:  # was torch's "Torch not compiled with CUDA enabled"
        main(["--random", "--device", "cuda", "--prompts", "1", "--n", "1", "--new-tokens", "2"])
    assert e.value.code == 2 and "--device cuda: this machine has no CUDA device" in \
        capsys.readouterr().err


def test_weights_sync_ipc_device_has_an_index(monkeypatch, capsys):
    """Both ipc ranks call torch.cuda.set_device on the device, which refuses a bare "cuda"
    with a ValueError on a GPU as well (its index parse, checked here without one)."""
    from torch.cuda._utils import _get_device_index

    import bench.weights_sync as ws
    with pytest.raises(ValueError, match="specified index"):
        _get_device_index(torch.device("cuda"))  # what `--ipc --device cuda` handed to the ranks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert [ws.ipc_device(d) for d in ("cuda", "cuda:1", "cpu", None)] == \
        ["cuda:0", "cuda:1", "cpu", "cuda:0"]
    assert _get_device_index(torch.device(ws.ipc_device("cuda"))) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ws.ipc_device(None) == "cpu"
    with pytest.raises(SystemExit) as e:
        ws.main(["--ipc", "--device", "cuda", "--shape", "tiny", "--versions", "1"])
    assert e.value.code == 2 and "this machine has no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("bench,argv", [
    ("rollout_vs_hf", ["--no-cpu", "--repeats", "0"]),  # crashed after the warm-ups: median([])
    ("train_step", ["--no-cpu", "--gpu", "--iters", "0"]),  # likewise, after the warm-up steps
    ("weights_sync", ["--ipc", "--device", "cpu", "--shape", "tiny", "--versions", "0"]),  # ran 10
])
def test_benches_refuse_zero_timed_runs(monkeypatch, capsys, bench, argv):
    monkeypatch.setattr(sys, "path", [*sys.path, str(BENCH)])
    import importlib
    main = importlib.import_module(f"bench.{bench}").main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "0 is below 1" in capsys.readouterr().err


def test_calibrate_makes_the_profiles_folder_before_measuring(monkeypatch, tmp_path, capsys):
    """--out in a folder that does not exist yet: the profile was measured, then lost to a
    FileNotFoundError at the end; a folder given as --out is refused before measuring."""
    from types import SimpleNamespace

    import launch.calibrate as cal
    measured = []

    def measure(*a, **k):  # the minutes of measuring, skipped; Profile.save opens the file too
        measured.append(1)
        return SimpleNamespace(save=lambda path: Path(path).write_text("{}"))
    monkeypatch.setattr(cal, "measure", measure)
    out = tmp_path / "runs" / "gpu" / "profile.json"
    assert cal.main(["--model", "preset:tiny", "--out", str(out)]) == 0
    assert out.read_text() == "{}" and measured == [1]
    assert cal.main(["--model", "preset:tiny", "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err and measured == [1]


@pytest.mark.parametrize("rows,words", [("1", "1 is below 2"), ("3", "give an even number")])
def test_train_step_refuses_a_batch_fsdp_cannot_halve(capsys, rows, words):
    """The fsdp=2 run gives each rank half the rows (ids.chunk(2)): one row left rank 1 none
    (IndexError in its process), three gave 2 and 1 and reported rows_per_rank 1."""
    from bench.train_step import main
    with pytest.raises(SystemExit) as e:
        main(["--cpu-batch", rows, "--cpu-seq", "8", "--iters", "1", "--warmup", "0"])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_a_benchs_command_returns_its_output_and_its_time_out_ends_its_children(tmp_path):
    """bench.common.run_in_group (the benches' torchrun runs): the output comes back through
    files (parallel.spawn.Captured), and a time-out kills the command's whole process group, a
    child it started in the background too, instead of leaving it running."""
    import os
    import select
    from bench.common import run_in_group
    proc = run_in_group(["bash", "-c", "echo out; echo err >&2; exit 3"], dict(os.environ), 30)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")
    pid_file = tmp_path / "child"
    # the child's pid is written before the command blocks: `wait` on the child, for 60 s
    with pytest.raises(subprocess.TimeoutExpired):
        run_in_group(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], dict(os.environ), 3)
    try:
        pidfd = os.pidfd_open(int(pid_file.read_text()))
    except ProcessLookupError:
        return  # gone already
    try:  # readable once the process has ended (a zombie until init reaps it included)
        assert select.select([pidfd], [], [], 30)[0], "the background child outlived the time-out"
    finally:
        os.close(pidfd)


def test_a_bench_ended_by_sigterm_ends_its_commands_group(tmp_path):
    """bench/gpu_check.sh caps each section with `timeout`, whose SIGTERM reaches the bench but
    not its torchrun (a session of its own): the bench died at once, its clean-up skipped, and the
    run went on into the next timed section. Now the SIGTERM ends the command's group first, and
    then the bench, as before (a caller that catches SystemExit, pytest, is not kept alive)."""
    import os
    import select
    import signal
    import sys
    import time
    pid_file = tmp_path / "child"
    script = (f"from bench.common import run_in_group\n"
              f"import os\n"
              f"run_in_group(['bash', '-c', 'sleep 60 & echo $! > {pid_file}; wait'], "
              f"dict(os.environ), 120)\n")
    root = BENCH.parent
    bench = subprocess.Popen([sys.executable, "-c", script], cwd=root,
                             env={**os.environ, "PYTHONPATH": str(root)})
    try:
        for _ in range(600):  # the child's pid, once the command has started it
            if pid_file.is_file() and pid_file.read_text().strip():
                break
            time.sleep(0.05)
        pidfd = os.pidfd_open(int(pid_file.read_text()))
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) == -signal.SIGTERM  # ended by the signal, as without the clean-up
        try:  # readable once the process has ended
            assert select.select([pidfd], [], [], 30)[0], "the command's child outlived the bench"
        finally:
            os.close(pidfd)
    finally:
        bench.kill()
        bench.wait()


def test_convert_smollm2_refuses_a_folder_of_another_dtype(tmp_path, capsys):
    """--dtype bfloat16 over the float32 folder returned it as converted ("wrote ..."), its
    config saying float32."""
    from tools.convert_smollm2 import convert
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    assert convert(tmp_path, "float32") == tmp_path  # reused as it is
    with pytest.raises(SystemExit, match=r"holds the model in float32, not bfloat16: give another "
                                         r"--out"):
        convert(tmp_path, "bfloat16")
    # the command line says it kept the folder, not that it wrote it
    from tools.convert_smollm2 import main
    assert main(["--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out == (f"{tmp_path} already holds the converted model: kept "
                                       "(delete it to convert again)\n")
