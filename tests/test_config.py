from pathlib import Path

import pytest

from dflash_trainer.cli import main
from dflash_trainer.config import load_config
from dflash_trainer.rundir import save_config
from dflash_trainer.errors import ConfigError


def test_demo_recipe_loads_and_overrides_apply():
    cfg = load_config("demo", ["train.lr=1e-4", "drafter.tap_layer_ids=[0,2]"])
    assert cfg.train.lr == 1e-4
    assert cfg.drafter.tap_layer_ids == [0, 2]
    assert cfg.run.name == "demo"
    assert cfg.target.random_init == "tiny"


@pytest.mark.parametrize(
    "override, key_in_message",
    [
        ("train.lrr=1", "train.lrr"),
        ("nosuch.section=1", "nosuch"),
        ("train.lr=abc", "train.lr"),
        ("train.lr=-1", "train.lr"),
        ("train.lr=nan", "train.lr"),
        ("train.lr=inf", "train.lr"),
        ("train.grad_clip=nan", "train.grad_clip"),
        ("pipeline.num_targets=3", "pipeline.num_targets"),  # the demo runs colocated
        ("drafter.block_size=12", "drafter.gamma"),
        ("pipeline.min_ready=9", "pipeline.min_ready"),
        ("drafter.mask_token_id=-3", "drafter.mask_token_id"),
        ("data.max_length=2", "data.max_length"),
        ("run.device=tpu", "run.device"),
        ("drafter.flex_kernel_options.ROWS_GUARANTEED_SAFE=true", "drafter.flex_kernel_options.ROWS_GUARANTEED_SAFE"),
        ("drafter.flex_kernel_options.BACKEND=CUTE", "drafter.flex_kernel_options.BACKEND must be one of"),
        ("drafter.loss_kernel=triton", "drafter.loss_kernel"),
        ("drafter.mask_tiles=rows", "drafter.mask_tiles"),
        ("train.compile_mode=fast", "train.compile_mode"),
        ("pipeline.timeout_s=nan", "pipeline.timeout_s must be a finite number"),
        ("pipeline.liveness_timeout_s=inf", "pipeline.liveness_timeout_s must be a finite number"),
        ("eval.temperature=nan", "eval.temperature must be a finite number"),
        ("regenerate.temperature=nan", "regenerate.temperature must be a finite number"),
        ("regenerate.request_timeout_s=inf", "regenerate.request_timeout_s must be a finite number"),
        ("drafter.intermediate_size=0", "drafter.intermediate_size must be >= 1"),
        ("drafter.intermediate_size=-5", "drafter.intermediate_size must be >= 1"),
        ("eval.num_prompts=-3", "eval.num_prompts and eval.max_new_tokens must be >= 1, got -3 and"),
    ],
)
def test_bad_config_names_the_key(override, key_in_message):
    with pytest.raises(ConfigError, match=key_in_message.replace(".", r"\.")):
        load_config("demo", [override])


@pytest.mark.parametrize("override, hint", [
    ("train.learning_rate=1e-3", "Did you mean: 'train.lr'?"),  # another trainer's name, not a near spelling
    ("train.gradient_accumulation_steps=2", "Did you mean: 'train.grad_accum'?"),
    ("train.batch_size=4", "Did you mean: 'pipeline.token_budget'?"),  # ours lives in another section
    ("train.lrr=1e-3", "Did you mean: 'lr'?"),  # a near spelling: OmegaConf's own hint, kept
    ("target.path=Qwen/Qwen3-8B", "add target.random_init=null"),  # the demo recipe's random target
])
def test_a_wrong_key_or_a_clash_names_the_setting_to_use(override, hint):
    with pytest.raises(ConfigError) as error:
        load_config("demo", [override])
    assert hint in str(error.value)
    if override.startswith("target.path"):
        assert load_config("demo", [override, "target.random_init=null"]).target.path == "Qwen/Qwen3-8B"


def test_non_finite_floats_are_refused_in_lists_of_sections_too():
    with pytest.raises(ConfigError, match=r"data\.sources\[1\]\.weight must be a finite number, got inf"):
        load_config("demo", ["data.path=null", "data.sources=[{path: a}, {path: b, weight: .inf}]"])


def test_target_required():
    with pytest.raises(ConfigError, match="target.path"):
        load_config(None, [])


def test_unknown_recipe_is_clear():
    with pytest.raises(ConfigError, match="not found"):
        load_config("no-such-recipe", [])


def test_default_num_blocks_follows_recipe_density():
    cfg = load_config(None, ["target.random_init=tiny", "pipeline.token_budget=3072"])
    assert cfg.batch.num_blocks == 512
    cfg = load_config(None, ["target.random_init=tiny", "drafter.num_blocks=7"])
    assert cfg.batch.num_blocks == 7


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config("demo", ["train.lr=2e-4"])
    path = save_config(cfg, tmp_path)
    again = load_config(path, [])
    assert again == cfg


def test_cli_reports_config_errors(capsys):
    assert main(["plan", "--config", "demo", "train.nope=1"]) == 2
    assert "train.nope" in capsys.readouterr().err


def test_there_is_no_bench_subcommand(capsys):
    """The benchmarks are scripts and suites in the source tree's bench/ (bench/README.md), not a subcommand."""
    with pytest.raises(SystemExit):
        main(["bench", "--config", "demo"])
    assert "invalid choice: 'bench'" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("train:\n  lr: [1\n", r"not valid YAML \(line 3, column 1\): did not find expected"),
    ("- run\n- train\n", "the top level must be a mapping of sections"),
    ("train:\n  lr: 1e-3\n  lr: 2e-3\n", r"not valid YAML \(line 3, column 3\): found duplicate key lr"),
], ids=["syntax", "list", "duplicate-key"])
def test_bad_recipe_files_are_named_errors(tmp_path, text, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"recipe {path}: {message}"):
        load_config(str(path))


@pytest.mark.parametrize("argv, option, value", [
    (["train", "data.path=D", "--resume", "run.dir=X"], "resume", True),
    (["train", "run.dir=X", "--overwrite"], "overwrite", True),
    (["plan", "run.dir=X", "--config", "demo"], "config", "demo"),
    (["eval", "eval.num_prompts=2", "--drafter", "E", "run.dir=X"], "drafter", "E"),
    (["export", "run.dir=X", "--checkpoint", "C", "--out", "O"], "checkpoint", "C"),
    (["regenerate", "regenerate.batch_size=2", "--out", "O", "run.dir=X"], "out", "O"),
    (["report", "RUN", "--out", "O"], "out", "O"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_options_are_accepted_after_the_overrides(argv, option, value, capsys):
    from dflash_trainer.cli import parse_args

    args = parse_args(argv)
    assert args.command == argv[0] and getattr(args, option) == value
    assert [o for o in getattr(args, "overrides", []) if "=" in o] == [a for a in argv if "=" in a]
    # through main: the option after an override is read, and the override reaches the config
    assert main(["export", "train.nope=1", "--checkpoint", "C", "--out", "O"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" not in err and "train.nope" in err


def test_the_test_script_runs_the_tests_it_is_given():
    """`bash scripts/test.sh tests/test_layers.py` collects that file's tests alone (not the whole suite)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["bash", "scripts/test.sh", "tests/test_layers.py", "--collect-only"], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    assert collected and all(line.startswith("tests/test_layers.py::") for line in collected), collected[:5]


@pytest.mark.parametrize("recipe", sorted(p.name for p in (Path(__file__).parents[1] / "configs").glob("*.yaml")))
def test_every_shipped_recipe_loads(recipe):
    """Each recipe in configs/ passes validation as shipped (a typo in one fails here, not at a user's start)."""
    cfg = load_config(Path(__file__).parents[1] / "configs" / recipe, [])
    assert cfg.target.path or cfg.target.random_init


def test_the_8b_recipe_trains_with_muon_and_its_adamw_is_named_by_the_error():
    """configs/qwen3-8b.yaml trains with Muon at its own lr; `train.optimizer=adamw` alone would leave that lr set
    and unread, so it is refused with the second override that makes the run AdamW's."""
    recipe = Path(__file__).parents[1] / "configs" / "qwen3-8b.yaml"
    cfg = load_config(recipe, [])
    assert cfg.train.optimizer == "muon" and cfg.train.muon_peak_lr == pytest.approx(2e-3)
    with pytest.raises(ConfigError, match=r"train.muon_lr=0.002 is read only with train.optimizer=muon.*"
                                          r"train.muon_lr=null where a recipe sets it"):
        load_config(recipe, ["train.optimizer=adamw"])
    adamw = load_config(recipe, ["train.optimizer=adamw", "train.muon_lr=null"])
    assert adamw.train.optimizer == "adamw" and adamw.train.muon_lr is None


def test_a_config_mistake_is_named_before_torch_is_imported():
    """Config mistakes are named in well under a second, even on a loaded machine: torch's import comes later."""
    import subprocess
    import sys

    code = ("import sys; from dflash_trainer.cli import main; rc = main(['train', '--config', 'demo', 'train.lrr=1']); "
            "print(rc, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    assert "Did you mean: 'lr'?" in proc.stderr


@pytest.mark.parametrize("overrides, message", [
    (["drafter.noise_std=0.1"], "drafter.noise_std=0.1 is read only with drafter.noise=uniform or gaussian"),
    (["drafter.noise_std_final=0.1"], "drafter.noise_std_final=0.1 is read only with drafter.noise="),
    (["drafter.dpace_alpha=0.3"], "drafter.dpace_alpha=0.3 is read only with drafter.dpace=true"),
    (["drafter.sliding_window=4"], "drafter.sliding_window=4 is read only with drafter.sliding_layers"),
    (["train.muon_momentum=0.9"], "train.muon_momentum=0.9 is read only with train.optimizer=muon"),
    (["train.decay_ratio=0.5"], "train.decay_ratio=0.5 is read only with train.schedule=wsd"),
    (["regenerate.url=http://127.0.0.1:8000/v1"], "regenerate.url=http://127.0.0.1:8000/v1 is read only with "
                                                  "regenerate.backend=openai"),
    (["regenerate.model=org/model"], "regenerate.model=org/model is read only with regenerate.backend=openai"),
])
def test_an_option_whose_switch_is_off_is_refused_naming_the_switch(overrides, message):
    """Set off its default while the setting that turns it on is off, an option would change nothing: the run
    would train as if it were not given."""
    with pytest.raises(ConfigError) as error:
        load_config("demo", overrides)
    assert message in str(error.value) and ("set " in str(error.value))


@pytest.mark.parametrize("overrides", [
    ["drafter.noise=uniform", "drafter.noise_std=0.1"],
    ["drafter.noise=gaussian", "drafter.noise_std=0.1", "drafter.noise_std_final=0.0"],
    ["drafter.dpace=true", "drafter.dpace_alpha=0.3"],
    ["drafter.sliding_layers=[0]", "drafter.sliding_window=4"],
    ["train.optimizer=muon", "train.muon_momentum=0.9"],
    ["train.schedule=wsd", "train.decay_ratio=0.5"],
    ["regenerate.backend=openai", "regenerate.url=http://127.0.0.1:8000/v1", "regenerate.model=org/model"],
])
def test_the_same_options_with_their_switch_on_load(overrides):
    load_config("demo", overrides)


def test_a_block_of_one_slot_is_named_as_such_on_a_drafter_without_convolutions():
    """drafter.block_size=1 on DFlash: the block size is named, not DFlash2's convolution it does not use."""
    for variant in ("dflash", "dflash2"):
        with pytest.raises(ConfigError, match=r"drafter\.block_size must be >= 2"):
            load_config("demo", [f"drafter.variant={variant}", "drafter.block_size=1"])
    load_config("demo", ["drafter.block_size=2", "drafter.gamma=1", "drafter.conv_kernel_size=2"])


@pytest.mark.parametrize("override, fix", [
    ("train.lr=abc", "give a number (such as 3e-4)"),
    ("train.num_epochs=1.5", "give a whole number"),
    ("logging.progress=maybe", "give true or false"),
])
def test_a_value_of_the_wrong_type_says_what_to_give(override, fix):
    with pytest.raises(ConfigError) as error:
        load_config("demo", [override])
    assert str(error.value).endswith(fix) and override.split("=")[0] in str(error.value)
