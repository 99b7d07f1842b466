"""A resume with a config that differs from the checkpoint's run's: rank 0 says in one line what
changed and what the resume does with each setting, and refuses the changes that would silently
change the run's objective (the KL reference, the temperature of buffered groups' log-probs)."""
from pathlib import Path

import pytest

from config import load_config
from tests.test_bad_input import good_model  # noqa: F401 (a fixture)
from tests.test_checkpoint_dcp import _checkpoints
from trainer.checkpointing import check_resume, read_extra, settings_of

GROUP = {"prompt_id": 0, "trajectories": [{}] * 4}


def _cfg(run, *overrides):
    return load_config("configs/tiny_cpu.toml", [f"--run.dir={run}", *overrides]).resolve(3)


def _saved_by(old, groups: int = 0):
    """A checkpoint of step 4 in old's run folder, as `save` writes its extra.json."""
    root = Path(old.run.dir) / "checkpoints"
    _checkpoints(root, {4: {"settings": settings_of(old), "generators": {"0": {}},
                            "buffer": {"groups": [GROUP] * groups}}})
    return root / "step_000004"


def _line(cfg, path):
    from trainer.checkpointing import resume_changes_line
    return resume_changes_line(cfg, path, read_extra(path))


def test_a_resume_says_which_settings_changed_and_what_happens_to_each(tmp_path):
    """A changed trainer.lr was applied (keep_config_hyperparameters) without a word: the log did
    not tell whether the new value or the checkpoint's took effect. One line now lists every
    changed setting under what the resume does with it."""
    old = _cfg(tmp_path)
    path = _saved_by(old, groups=2)
    assert _line(_cfg(tmp_path), path) is None  # the same config: nothing to say
    new = _cfg(tmp_path, "--trainer.lr=2e-5", "--trainer.seed=7", "--generator.top_p=0.9",
               "--logging.console_every=5", f"--checkpoint.resume={path}")
    line = _line(new, path)
    assert "\n" not in line and line.startswith(f"resuming {path} (step 4) with settings changed")
    applied, groups, kept = line.split("; ")[-3:]
    assert applied.endswith(f"applied: trainer.lr {old.trainer.lr!r} -> 2e-05 (the lr schedule "
                            "keeps its position), logging.console_every 1 -> 5")
    assert groups == ("applied to groups generated from now on (the checkpoint's 2 buffered groups "
                      "keep the old): generator.top_p 1.0 -> 0.9")
    assert kept == (f"kept from the checkpoint: trainer.seed {old.trainer.seed!r} -> 7 (its RNG "
                    "state is restored)")
    assert "checkpoint.resume" not in line  # how to resume, not a setting of the run


def test_only_the_counted_settings_are_refused_and_older_checkpoints_still_resume(tmp_path):
    """With every setting saved, the ones the gates, cursors and buffer were counted in are still
    the only ones refused; a checkpoint that saved only those (or none) resumes as before, with
    nothing to compare the rest with."""
    old = _cfg(tmp_path)
    _saved_by(old)
    check_resume(_cfg(tmp_path, "--trainer.lr=3e-5", "--algo.loss=ppo", "--parallel.timeout_s=9"))
    with pytest.raises(ValueError, match=r"trainer.prompts_per_step=\d+ \(the checkpoint's run: "):
        check_resume(_cfg(tmp_path, f"--trainer.prompts_per_step={old.trainer.prompts_per_step + 1}"))
    older = tmp_path / "older"
    counted = {k: v for k, v in settings_of(old).items()
               if k in ("trainer.prompts_per_step", "generator.n_samples", "parallel.gen_dp")}
    _checkpoints(older / "checkpoints", {4: {"settings": counted}})
    new = _cfg(older, "--trainer.lr=3e-5", "--model.path=elsewhere", "--algo.kl_coef=0.1")
    check_resume(new)
    assert _line(new, older / "checkpoints" / "step_000004") is None


def test_a_resume_that_moves_the_kl_reference_is_refused(tmp_path):
    """model.ref_path '' means the starting policy, model.path. A resume with another model.path
    keeps the checkpoint's policy weights but moved the KL reference to the new folder: the
    objective changed mid-run without a word. Refused naming both folders and the fix; a
    reference set explicitly (the old one, or the new one) is applied and listed."""
    first, moved = str(tmp_path / "first"), str(tmp_path / "moved")
    old = _cfg(tmp_path, f"--model.path={first}", "--algo.kl_coef=0.1")
    path = _saved_by(old)
    with pytest.raises(ValueError, match=(
            rf"with model.path='{moved}' and algo.kl_coef=0.1 would move the KL penalty's "
            rf"reference model from '{first}' \(the checkpoint's run's\) to '{moved}'.*"
            rf"Set --model.ref_path={first} to keep the run's reference, or "
            rf"--model.ref_path={moved} if the reference should change")):
        check_resume(_cfg(tmp_path, f"--model.path={moved}", "--algo.kl_coef=0.1"))
    check_resume(_cfg(tmp_path, f"--model.path={first}/.", "--algo.kl_coef=0.1"))  # one folder
    keep = _cfg(tmp_path, f"--model.path={moved}", "--algo.kl_coef=0.1", f"--model.ref_path={first}")
    check_resume(keep)
    line = _line(keep, path)
    assert (f"applied: model.path '{first}' -> '{moved}' (tokenizer and model config; the "
            "policy's weights are the checkpoint's)") in line and "model.ref_path" not in line
    change = _cfg(tmp_path, f"--model.path={moved}", "--algo.kl_coef=0.1", f"--model.ref_path={moved}")
    check_resume(change)
    assert f"model.ref_path '{first}' -> '{moved}' (the KL penalty's reference)" in _line(change, path)
    # without KL now the reference is unused: applied, and the line says how to keep it
    no_kl = _cfg(tmp_path, f"--model.path={moved}", "--algo.kl_coef=0")
    check_resume(no_kl)
    assert (f"model.ref_path '{first}' -> '{moved}' (the KL reference; unused while "
            f"algo.kl_coef=0, set --model.ref_path={first} to keep the run's)") in _line(no_kl, path)
    # KL turned on at a resume that also moves model.path: the reference is not the start either
    plain = tmp_path / "plain"
    _saved_by(_cfg(plain, f"--model.path={first}"))
    with pytest.raises(ValueError, match=rf"reference model from '{first}'.* to '{moved}'"):
        check_resume(_cfg(plain, f"--model.path={moved}", "--algo.kl_coef=0.1"))
    check_resume(_cfg(plain, f"--model.path={first}", "--algo.kl_coef=0.1"))


def test_a_resume_at_another_temperature_applies_it_to_new_groups_only(tmp_path):
    """The buffered groups' log-probs (mu) are those of the distribution they were sampled from,
    so their importance weights against the trainer's policy at the new temperature correct for
    the change as for any lag: the resume goes on, and says the buffered groups keep theirs."""
    path = _saved_by(_cfg(tmp_path, "--generator.temperature=1.0"), groups=3)
    hotter = _cfg(tmp_path, "--generator.temperature=0.7")
    check_resume(hotter)
    assert ("applied to groups generated from now on (the checkpoint's 3 buffered groups keep "
            "the old): generator.temperature 1.0 -> 0.7") in _line(hotter, path)
    empty = tmp_path / "empty"
    path = _saved_by(_cfg(empty, "--generator.temperature=1.0"))
    hotter = _cfg(empty, "--generator.temperature=0.7")
    check_resume(hotter)
    assert "applied: generator.temperature 1.0 -> 0.7" in _line(hotter, path)


def test_preflight_prints_the_changes_on_rank_0_only(tmp_path, good_model, monkeypatch,  # noqa: F811
                                                     capsys):
    """The line comes before any process group, once (rank 0), for a real checkpoint."""
    from launch.preflight import preflight
    from model import load_pretrained
    from model.tokenizer import load_tokenizer
    from parallel.checkpoint import save_sharded
    from parallel.dims import ParallelDims
    from rollout.data import PromptSource
    from rollout.role import load_items
    base = [f"--model.path={good_model}", "--data.num_prompts=100"]
    old = _cfg(tmp_path, *base)
    items = load_items(old, load_tokenizer(good_model))[0]
    cursor = PromptSource(items, seed=old.data.seed, shuffle=old.data.shuffle).state_dict()
    step = tmp_path / "checkpoints" / "step_000002"
    save_sharded(step, load_pretrained(good_model), extra={
        "step": 2, "version": 2, "settings": settings_of(old),
        "generators": {"0": {"cursor": cursor, "inflight": [], "started": 8}}})
    new = _cfg(tmp_path, *base, "--trainer.lr=3e-5")
    for rank, lines in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        capsys.readouterr()
        preflight(new, ParallelDims.from_config(new.parallel, 3))
        out = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("resuming")]
        assert len(out) == lines, out
    assert f"trainer.lr {old.trainer.lr!r} -> 3e-05" in out[0]


def test_a_missing_kl_reference_folder_is_refused_before_process_groups(tmp_path, good_model,  # noqa: F811
                                                                        monkeypatch):
    """model.ref_path was first read by the trainer after start-up; the fix a moved reference's
    refusal names may be a folder that is gone."""
    from config import ConfigError
    from launch.preflight import preflight
    from parallel.dims import ParallelDims
    monkeypatch.setenv("RANK", "0")
    gone = tmp_path / "gone"
    cfg = _cfg(tmp_path / "run", f"--model.path={good_model}", "--algo.kl_coef=0.1",
               f"--model.ref_path={gone}")
    with pytest.raises(ConfigError, match=rf"'{gone}' \(model.ref_path, the KL penalty's reference "
                                          r"with algo.kl_coef=0.1\) does not exist"):
        preflight(cfg, ParallelDims.from_config(cfg.parallel, 3))
    cfg = _cfg(tmp_path / "run", f"--model.path={good_model}", "--algo.kl_coef=0.1",
               f"--model.ref_path={good_model}")
    preflight(cfg, ParallelDims.from_config(cfg.parallel, 3))


def _group(made_at: int, samples: int = 4) -> dict:
    """A buffered group as `OffPolicyBuffer.state_dict` saves it, generated at version `made_at`."""
    return {"prompt_id": made_at, "replica": 0,
            "trajectories": [{"token_versions": [made_at, made_at + 1]}] * samples}


def test_a_resume_that_lowers_max_staleness_below_its_buffers_needs_is_refused(tmp_path):
    """The checkpoint of a max_staleness=2 run buffers groups made two versions before the steps
    that take them. Resumed with max_staleness=1 the first step dropped 4 of them as stale (their
    prompts never trained, nothing said); with 0 it dropped all 8 at once and the trainer waited
    for groups the generator's gate would not start, until parallel.timeout_s. Refused now,
    naming the least max_staleness that trains them all (hand count: backlog group j is taken
    at version 4 + j // 4; the first four were made at 2, the next four at 3: 2 behind)."""
    import doctest

    import trainer.checkpointing
    from trainer.checkpointing import staleness_needed
    assert doctest.testmod(trainer.checkpointing).failed == 0
    old = _cfg(tmp_path, "--algo.max_staleness=2", "--trainer.prompts_per_step=4",
               "--generator.n_samples=4")
    root = tmp_path / "checkpoints"
    groups = [_group(2)] * 4 + [_group(3)] * 4
    _checkpoints(root, {4: {"version": 4, "settings": settings_of(old),
                            "buffer": {"groups": groups},
                            "generators": {"0": {"inflight": [], "started": 24}}}})
    assert staleness_needed(read_extra(root / "step_000004"), batch_groups=4) == 2
    for lower in (0, 1):
        with pytest.raises(ValueError, match=(
                rf"with algo.max_staleness={lower} \(the checkpoint's run: 2\): its 8 buffered and "
                r"in-flight groups are trained up to 2 versions after .* Resume with "
                r"--algo.max_staleness=2 or more")):
            check_resume(_cfg(tmp_path, f"--algo.max_staleness={lower}",
                              "--algo.buffer_capacity=32", "--trainer.prompts_per_step=4",
                              "--generator.n_samples=4"))
    with pytest.raises(ValueError, match=(  # the bigger buffer alone was a dead end
            r"set --algo.buffer_capacity=32 or more, and --algo.max_staleness=2 or more")):
        check_resume(_cfg(tmp_path, "--algo.max_staleness=0", "--trainer.prompts_per_step=4",
                          "--generator.n_samples=4"))
    for same_or_more in (2, 3):
        check_resume(_cfg(tmp_path, f"--algo.max_staleness={same_or_more}",
                          "--trainer.prompts_per_step=4", "--generator.n_samples=4"))
    # in-flight groups are regenerated at the checkpoint's version, after the buffered ones:
    # 4 buffered (made at 4) and 5 in flight take versions 4, 4, 4, 4, 5, 5, 5, 5, 6: 2 behind
    extra = {"version": 4, "buffer": {"groups": [_group(4)] * 4},
             "generators": {"0": {"inflight": [[1, 0]] * 3}, "1": {"inflight": [[2, 0]] * 2}}}
    assert staleness_needed(extra, batch_groups=4) == 2
    assert staleness_needed({"version": 4}, batch_groups=4) == 0  # an empty cut: any


def test_a_refused_gen_dp_change_names_the_generator_ranks_that_give_it(tmp_path):
    """gen_dp is derived (generator_ranks / gen_tp). A job requeued onto fewer generator ranks
    was told "Resume with --parallel.gen_dp=2", which the layout check then refused (gen_tp x
    gen_dp = 1 x 2 != 1 generator ranks). The fix names the generator ranks, and the world size."""
    old = _cfg(tmp_path, "--parallel.generator_ranks=2")
    _saved_by(old)
    new = load_config("configs/tiny_cpu.toml", [f"--run.dir={tmp_path}",
                                                "--parallel.generator_ranks=1"]).resolve(2)
    with pytest.raises(ValueError, match=(
            r"with parallel.gen_dp=1 \(the checkpoint's run: 2\).* Resume with "
            r"--parallel.generator_ranks=2 \(2 replicas x gen_tp=1; with this run's 1 trainer "
            r"ranks, a world size of 3\)")) as e:
        check_resume(new)
    fixed = load_config("configs/tiny_cpu.toml", [f"--run.dir={tmp_path}",
                                                  "--parallel.generator_ranks=2"]).resolve(3)
    assert "--parallel.gen_dp" not in str(e.value) and fixed.parallel.gen_dp == 2
    check_resume(fixed)


def test_a_finished_run_without_checkpoints_is_not_silently_started_over(tmp_path):
    """A colocated run (no checkpoints) relaunched in split mode to resume it, or any run of
    checkpoint.every_steps=0 relaunched with a higher trainer.max_steps: it started over at step
    0 without a word and overwrote the finished run's metrics and hf_final."""
    from trainer.checkpointing import already_complete_line, mark_complete
    colocated = _cfg(tmp_path, "--parallel.mode=colocated", "--checkpoint.every_steps=0",
                     "--trainer.max_steps=4")
    mark_complete(colocated, 4)
    with pytest.raises(ValueError, match=(
            rf"run {tmp_path} already completed 4 steps and has no checkpoint to train on from "
            r".*\(trainer.max_steps=6, parallel.mode='split'\) would start over at step 0 and "
            r"overwrite its metrics and hf_final. Pass a new --run.dir")):
        check_resume(_cfg(tmp_path, "--trainer.max_steps=6"))
    check_resume(_cfg(tmp_path, "--trainer.max_steps=6", "--checkpoint.resume=never"))  # asked for
    same = _cfg(tmp_path, "--trainer.max_steps=4")
    check_resume(same)  # nothing to do, as already_complete_line says
    assert already_complete_line(same) == (
        f"run {tmp_path} already completed 4 steps (trainer.max_steps=4): nothing to do. It saved "
        "no checkpoint to train on from: pass a new --run.dir to run again")
    check_resume(_cfg(tmp_path / "new", "--trainer.max_steps=6"))  # a new folder


def test_a_straggler_in_the_buffer_does_not_refuse_a_resume_of_the_same_staleness(tmp_path):
    """A long completion started at version 0 arrived after steps 1-2 had taken shorter groups:
    the run would drop it at its next take (its gates count the drop), and the resume of the
    same config must do as it would. The staleness refusal is for a lowered max_staleness only,
    and never asks for more than the run's own."""
    args = ("--algo.max_staleness=1", "--trainer.prompts_per_step=2", "--generator.n_samples=4")
    straggler = {"prompt_id": 0, "replica": 0, "trajectories": [{"token_versions": [0, 0]}] * 4}
    _checkpoints(tmp_path / "checkpoints",
                 {2: {"version": 2, "settings": settings_of(_cfg(tmp_path, *args)),
                      "buffer": {"groups": [straggler]},
                      "generators": {"0": {"inflight": [], "started": 5}}}})
    check_resume(_cfg(tmp_path, *args))
    check_resume(_cfg(tmp_path, *args[1:], "--algo.max_staleness=3"))
    with pytest.raises(ValueError, match=r"max_staleness=0 \(the checkpoint's run: 1\).* Resume "
                                         r"with --algo.max_staleness=1 or more"):
        check_resume(_cfg(tmp_path, *args[1:], "--algo.max_staleness=0", "--algo.buffer_capacity=64"))
