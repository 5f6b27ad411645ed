"""`benchmarks/learning_suite.py --quick` runs every game in both modes end to end and writes its three outputs."""

import importlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

import llamagym.envs as suite

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_suite_trains_and_evaluates_every_game_in_both_modes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "benchmarks/learning_suite.py", "--quick", "--threads", "1", "--output", str(tmp_path)]
    cmd += ["--also-average", "2", "--keep-agents", "--replay", "sft_steps=1"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert {(r["game"], r["mode"]) for r in runs} == {(g, m) for g in suite.GAMES for m in ("score", "generate")}
    for run in runs:
        assert run["curve"][0]["train"] == 0 and run["train_s"] >= 3.0  # before training, then the budget
        assert run["updates"] >= 1, (run["game"], run["mode"])  # --quick trains past its budget to an update
        assert run["best"] >= max(run["before"], run["final"])
        assert run["peak_rss_gib"] > 0 and run["final_figures"]["random"] < run["final_figures"]["optimal"]
        assert run["cpu_gflops"] > 0  # the machine's speed beside the run's times
        # greedy acting uses the averaged adapter: the latest weights are evaluated beside it
        assert run["final_latest"] == run["curve"][-1]["latest_normalised"]
        assert 0.0 <= run["curve"][-1]["latest_invalid"] <= 1.0  # its invalid replies too
        assert run["curve"][-1]["avg2_normalised"] <= 1.0  # and the average over 2 (--also-average)
        assert 0.0 <= run["curve"][-1]["avg2_invalid"] <= 1.0  # with its invalid replies
    table = (tmp_path / "results.md").read_text()
    assert "| game | mode | seed | before | best | final | latest |" in table and "model: tiny-random" in table
    assert "| RSS (GiB) | GFLOP/s |" in table
    assert all((tmp_path / f"{game}.png").stat().st_size > 0 for game in suite.GAMES)
    assert "'replay': {'sft_steps': 1}" in table
    kept = sorted(p.name for p in (tmp_path / "agents").iterdir())
    assert kept == sorted(f"{r['game']}-{r['mode']}-seed0" for r in runs)


def test_a_run_on_two_threads_finishes_in_its_forked_child(tmp_path):
    """Each run is a forked child: a parent that ran a multi-threaded torch op before forking left the child hung in
    OpenMP (a 20-minute run made no progress in 10). Two threads, as the benchmark's default, one game."""
    env = {**os.environ}
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "benchmarks/learning_suite.py", "--quick", "--threads", "2", "--output", str(tmp_path)]
    cmd += ["--games", "rooms", "--modes", "score"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert "error" not in run and run["updates"] >= 1 and run["cpu_gflops"] > 0  # the speed, measured in the child


def test_greedy_replies_lists_what_a_kept_agent_says_in_every_state(tmp_path, capsys):
    """`greedy_replies.py` reads an agent saved the way `--keep-agents` saves it, and lists one reply per state."""
    from llamagym import load_model_and_tokenizer

    learning_suite, greedy_replies = load_benchmark(), load_benchmark("greedy_replies")
    game = suite.get_game("guess_number")
    model, tokenizer = load_model_and_tokenizer("tiny-random")
    space = gym.make(game.env_id).action_space
    agent = learning_suite.make_agent(game, model, tokenizer, space, "generate", None)
    agent.save(tmp_path / "agent")
    common = ["--game", "guess_number", "--model", "tiny-random", "--threads", "1", "--envs", "2"]
    greedy_replies.main([*common, "--agent", str(tmp_path / "agent"), "--all", "--calls", "1"])
    out = capsys.readouterr().out
    asked = int(out.split(" distinct states asked")[0].rsplit("\n", 1)[-1])
    rows = [line for line in out.splitlines() if line.startswith("| ((16, ")]
    assert asked == len(rows) >= 5  # every state of the play-out once, at least the first guess's and its 4 next
    assert "Greedy replies' text: median" in out and "s a call; replies: median" in out
    sampled = [line for line in out.splitlines() if line.startswith("- ") and " -> " in line]
    assert len(sampled) == 2  # the first call's replies, with the action each played
    with pytest.raises(SystemExit):
        greedy_replies.parse_args([*common, "--agent", str(tmp_path / "missing")])


def load_benchmark(name: str = "learning_suite"):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def quick_probe_run(script: str, output: Path, *flags: str) -> tuple[dict, str]:
    """A probe benchmark's `--quick` run on one thread, with `flags` added: its one run of results.json, and what it
    printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, f"benchmarks/{script}", "--quick", "--threads", "1", "--output", str(output), *flags]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = json.loads((output / "results.json").read_text())["runs"]
    assert len(run["curve"]) == 2  # before training and at the end
    return run, done.stdout


def test_overrides_are_parsed_validated_and_reported():
    learning_suite = load_benchmark()
    args = learning_suite.parse_args(["--quick", "--ppo", "learning_rate=1e-3", "whiten_advantages=False"])
    assert args.overrides["ppo"] == {"learning_rate": 1e-3, "whiten_advantages": False}
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--ppo", "learning_rate=-1"])
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--modes", "telepathy"])
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--group-size", "0"])
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--min-updates", "-1"])
    assert learning_suite.parse_args(["--quick"]).min_updates == 1 and learning_suite.parse_args([]).min_updates == 0
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--device", "tpu"])
    assert learning_suite.parse_args(["--also-average", "3,5"]).also_average == [3, 5]
    assert learning_suite.parse_args([]).also_average == []
    assert learning_suite.parse_args(["--replay", "sft_steps=4"]).overrides["replay"] == {"sft_steps": 4}
    with pytest.raises(SystemExit):
        learning_suite.parse_args(["--replay", "sft_steps=-1"])
    for bad in ("0", "three"):
        with pytest.raises(SystemExit):
            learning_suite.parse_args(["--also-average", bad])


def test_groups_of_envs_share_a_seed_per_episode_and_nothing_else_does():
    group_seed = load_benchmark().group_seed
    seeds = {
        (env, episode): group_seed(3, env, episode, num_envs=5, group_size=2)
        for env in range(5)
        for episode in range(3)
    }
    for episode in range(3):
        assert seeds[0, episode] == seeds[1, episode] and seeds[2, episode] == seeds[3, episode]
    distinct = {(env // 2, episode) for env, episode in seeds}
    assert len(set(seeds.values())) == len(distinct) == 9  # 3 groups (the last of one env) x 3 episodes


def test_the_cpu_is_named_with_its_family_and_model_where_cpuinfo_gives_them():
    cpu_model = load_benchmark().cpu_model
    zen4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    other = zen4.replace("processor\t: 0", "processor\t: 1").replace(": 17", ": 99")
    assert cpu_model(zen4 + other) == "AMD EPYC (family 25, model 17)"  # the first processor's
    assert cpu_model("processor\t: 0\nmodel name\t: Some ARM core\n") == "Some ARM core"  # no family: the name
    assert cpu_model("") == (platform.processor() or platform.machine())  # no model name: what the platform says
