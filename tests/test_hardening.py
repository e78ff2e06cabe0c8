"""Hostile input: damaged files, outputs that would destroy something, settings that train garbage, a second
concurrent stream, prompts at the edge of the context. Each case ends in one `specula: error:` line and exit 2
(or the library's SpeculaError) with nothing written or damaged — or, at the context edge, in vanilla's tokens.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import LLAMA2XS, REPO, STORIES, copy_dir, fingerprint, one_error
from safetensors.torch import load_file, save_file
from torch import nn

import specula
from specula.cli import main
from specula.errors import SpeculaError
from specula.files.outputs import MARKER, atomic_write, atomic_write_text, prepare_output_dir
from specula.runtime.target import FeatureRequest
from specula.training.loop import TrainConfig, run_training

EAGLE = REPO / "tests" / "data" / "eagle-stories260k"
EAGLE3 = REPO / "tests" / "data" / "eagle3-stories260k"
MEDUSA = REPO / "specula" / "heads" / "bundled" / "medusa-stories260k"
PROMPT = "Once upon a time"

pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------- helpers


def edit_tensors(file: Path, edit) -> None:
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def edit_config(file: Path, edit) -> None:
    file.write_text(json.dumps(edit(json.loads(file.read_text()))))


def generate(*args) -> int:
    return main(["generate", "--prompt", PROMPT, "--max-new-tokens", "4", "--dtype", "float32", *map(str, args)])


# ---------------------------------------------------------------- 1. loading checks what it loaded

TARGET_DAMAGE = {
    "missing tensor": (lambda d: edit_tensors(d / "model.safetensors",
                                              lambda t: t.pop("model.layers.2.mlp.down_proj.weight")),
                       "1 missing tensor (model.layers.2.mlp.down_proj.weight)"),
    "unexpected tensor": (lambda d: edit_tensors(d / "model.safetensors",
                                                 lambda t: t.update({"model.layers.9.extra": torch.zeros(3)})),
                          "1 unexpected tensor (model.layers.9.extra)"),
    "wrong shape": (lambda d: edit_tensors(d / "model.safetensors", lambda t: t.update(
        {"model.layers.1.mlp.up_proj.weight": t["model.layers.1.mlp.up_proj.weight"][:-1].contiguous()})),
        "of the wrong shape (model.layers.1.mlp.up_proj.weight"),
    "truncated weights": (lambda d: truncate(d / "model.safetensors"), "model.safetensors is damaged"),
    "truncated by a few bytes": (lambda d: truncate(d / "model.safetensors", 0.999), "model.safetensors is damaged"),
    "empty weights": (lambda d: (d / "model.safetensors").write_bytes(b""), "model.safetensors is damaged"),
    "garbage weights": (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), "is damaged"),
    "config is a list": (lambda d: (d / "config.json").write_text("[]"), "must be a JSON object, not a list"),
    "config size is a string": (lambda d: edit_config(d / "config.json", lambda c: {**c, "hidden_size": "64"}),
                                "'hidden_size' must be a whole number >= 1"),
    "config layer count negative": (lambda d: edit_config(d / "config.json",
                                                          lambda c: {**c, "num_hidden_layers": -1}),
                                    "'num_hidden_layers' must be a whole number >= 1"),
}


@pytest.mark.parametrize("damage", list(TARGET_DAMAGE))
def test_a_damaged_target_is_one_error_line(damage, tmp_path, capsys):
    model = copy_dir(STORIES, tmp_path / "model")
    apply, message = TARGET_DAMAGE[damage]
    apply(model)
    before = fingerprint(model)
    line = one_error(capsys, generate("--target", model))
    assert message in line and "target" in line
    assert fingerprint(model) == before


@pytest.mark.parametrize("damage", ["missing tensor", "truncated weights", "unexpected tensor"])
def test_a_damaged_draft_model_is_one_error_line(damage, tmp_path, capsys):
    draft = copy_dir(LLAMA2XS, tmp_path / "draft")
    TARGET_DAMAGE[damage][0](draft)
    line = one_error(capsys, generate("--target", STORIES, "--method", "sps", "--draft", draft))
    assert "draft" in line and str(draft) in line


def drop(name: str):
    return lambda t: t.pop(name)


def reshape(name: str):
    return lambda t: t.update({name: t[name][..., :-1].contiguous()})


def retype(name: str):
    return lambda t: t.update({name: t[name].to(torch.int32)})


def add(name: str):
    return lambda t: t.update({name: torch.zeros(2)})


HEADS = {  # method, head directory, weights file within it, a tensor in it
    "eagle": ("eagle2", EAGLE, "model.safetensors", "fc.weight"),
    "eagle3": ("eagle3", EAGLE3, "model.safetensors", "midlayer.mlp.down_proj.weight"),
    "medusa": ("medusa", MEDUSA, "medusa_lm_head.safetensors", "1.0.linear.weight"),
    "ldlp": ("ada", EAGLE, "ldlp/model.safetensors", "layers.1.weight"),
}
HEAD_DAMAGE = {
    "truncated": (lambda file, name: truncate(file), "damaged"),
    "empty": (lambda file, name: file.write_bytes(b""), "damaged"),
    "missing tensor": (lambda file, name: edit_tensors(file, drop(name)), "missing|lacks"),
    "wrong shape": (lambda file, name: edit_tensors(file, reshape(name)), "shape"),
    "unexpected tensor": (lambda file, name: edit_tensors(file, add("extra.weight")), "extra.weight"),
    "integer weights": (lambda file, name: edit_tensors(file, retype(name)), "stored as int32"),
}


def head_copy(kind: str, tmp_path: Path) -> tuple[str, Path, Path]:
    method, source, weights, _ = HEADS[kind]
    head = copy_dir(source, tmp_path / "head")
    return method, head, head / weights


@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("damage", list(HEAD_DAMAGE))
def test_a_damaged_head_is_one_error_line(kind, damage, tmp_path, capsys):
    method, head, weights = head_copy(kind, tmp_path)
    apply, message = HEAD_DAMAGE[damage]
    apply(weights, HEADS[kind][3])
    line = one_error(capsys, generate("--target", STORIES, "--method", method, "--draft", head))
    assert re.search(message, line) and str(head) in line, line


HEAD_CONFIGS = {  # kind, config file within the head, edit, message
    "eagle config is a list": ("eagle", "config.json", lambda c: [c], "must be a JSON object, not a list"),
    "eagle hidden size a string": ("eagle", "config.json", lambda c: {**c, "hidden_size": "64"}, "'hidden_size'"),
    "eagle zero heads": ("eagle", "config.json", lambda c: {**c, "num_attention_heads": 0}, "'num_attention_heads'"),
    "eagle eps not a number": ("eagle", "config.json", lambda c: {**c, "rms_norm_eps": "tiny"}, "'rms_norm_eps'"),
    "eagle bias not a bool": ("eagle", "config.json", lambda c: {**c, "bias": "yes"}, "'bias'"),
    "eagle3 config is a string": ("eagle3", "config.json", lambda c: "eagle3", "not a string"),
    "eagle3 eagle_config a list": ("eagle3", "config.json", lambda c: {**c, "eagle_config": [1, 2]}, "'eagle_config'"),
    "eagle3 draft vocab float": ("eagle3", "config.json", lambda c: {**c, "draft_vocab_size": 25.5},
                                 "'draft_vocab_size'"),
    "ldlp config is a list": ("ldlp", "ldlp/config.json", lambda c: [], "not a list"),
    "ldlp max length a string": ("ldlp", "ldlp/config.json", lambda c: {**c, "max_draft_length": "8"},
                                 "'max_draft_length'"),
    "medusa config is a list": ("medusa", "config.json", lambda c: [c], "not a JSON object"),
    "medusa head count a string": ("medusa", "config.json", lambda c: {**c, "medusa_num_heads": "4"},
                                   "'medusa_num_heads'"),
    "medusa tree of the wrong type": ("medusa", "medusa_choices.json", lambda c: {"choices": "deep"}, "tree"),
}


@pytest.mark.parametrize("case", list(HEAD_CONFIGS))
def test_a_head_config_of_the_wrong_type_is_one_error_line(case, tmp_path, capsys):
    kind, name, edit, message = HEAD_CONFIGS[case]
    method, head, _ = head_copy(kind, tmp_path)
    edit_config(head / name, edit)
    line = one_error(capsys, generate("--target", STORIES, "--method", method, "--draft", head))
    assert message in line, line


PROFILES = {
    "a list": ([], "not a JSON object"),
    "methods a list": ({"methods": []}, "'methods'"),
    "a method entry a list": ({"methods": {"pld": [4]}}, "methods.pld"),
    "defaults a string": ({"methods": {"pld": {"defaults": "fast"}}}, "methods.pld.defaults"),
    "device a number": ({"device": 0, "methods": {}}, "'device'"),
}


@pytest.mark.parametrize("case", list(PROFILES))
def test_a_hardware_profile_of_the_wrong_type_is_one_error_line(case, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path))
    profile, message = PROFILES[case]
    (tmp_path / "profile-stories260k.json").write_text(json.dumps(profile))
    line = one_error(capsys, generate("--target", STORIES, "--method", "pld"))
    assert "hardware profile" in line and message in line, line


def test_a_tree_choices_file_of_the_wrong_type_is_one_error_line(tmp_path, capsys):
    choices = tmp_path / "tree.json"
    choices.write_text(json.dumps({"choices": [[0]]}))
    line = one_error(capsys, generate("--target", STORIES, "--method", "eagle", "--draft", EAGLE,
                                      "--tree-choices", choices))
    assert "tree choices" in line


def feature_samples(target, count: int = 3) -> list:
    from specula.training.records import TrainingSample

    ids = torch.tensor(target.tokenizer("Once upon a time there was a little girl").input_ids)
    return [TrainingSample(ids[: 6 + k], torch.ones(6 + k, dtype=torch.bool)) for k in range(count)]


def test_a_truncated_feature_shard_is_refused_by_name_and_recomputed(stories_target, tmp_path):
    from specula.training.features import CachedFeatures, cache_features

    request = FeatureRequest(final_hidden=True)
    samples = feature_samples(stories_target)
    cache_features(stories_target, samples, tmp_path, request, shard_size=1, progress=False, log=None)
    good = CachedFeatures(tmp_path)[1]["hidden"].clone()
    shard = tmp_path / "features-00001.safetensors"
    truncate(shard)
    with pytest.raises(SpeculaError, match="feature shard .*features-00001.safetensors is damaged"):
        CachedFeatures(tmp_path)[1]
    messages = []
    cache_features(stories_target, samples, tmp_path, request, shard_size=1, progress=False, log=messages.append)
    assert any("features-00001" in m and "computing it again" in m for m in messages)
    assert torch.equal(CachedFeatures(tmp_path)[1]["hidden"], good)


def test_a_truncated_ldlp_label_file_is_refused_by_name(stories_target, tmp_path):
    from specula.heads.eagle_head import EagleHead
    from specula.training.features import OnlineFeatures
    from specula.training.ldlp_data import label_features

    features = OnlineFeatures(stories_target, feature_samples(stories_target), FeatureRequest(final_hidden=True))
    head = EagleHead.from_pretrained(EAGLE)
    label_features(head, stories_target, features, 3, tmp_path, "key", log=lambda _: None)
    (labels,) = tmp_path.glob("ldlp-labels-*.pt")
    truncate(labels)
    with pytest.raises(SpeculaError, match="LDLP labels file .*ldlp-labels"):
        label_features(head, stories_target, features, 3, tmp_path, "key", log=lambda _: None)


# ---------------------------------------------------------------- training runs on the command line


def write_records(path: Path, count: int = 12) -> Path:
    stories = ["Once upon a time there was a little cat. The cat liked to play with a ball.",
               "Tom went to the park with his mom. They saw a big dog and a red bird."]
    path.write_text("".join(json.dumps({"text": stories[i % 2] + f" Day {i}."}) + "\n" for i in range(count)))
    return path


def train_args(kind: str, data: Path, out: Path, cache: Path, *extra) -> list[str]:
    args = ["train", kind, "--target", STORIES, "--data", data, "--out", out, "--cache-dir", cache, "--epochs", "1",
            "--batch-size", "4", "--eval-samples", "2", "--gen-max-new-tokens", "8", "--warmup-steps", "1", *extra]
    if kind == "ldlp":
        args += ["--draft", EAGLE]
    return list(map(str, args))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_records(tmp_path_factory.mktemp("data") / "data.jsonl")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(out, cache, data) of a finished `train eagle` run: 2 epochs of 3 steps, a checkpoint every step."""
    root = tmp_path_factory.mktemp("run")
    data = write_records(root / "data.jsonl", 14)
    args = train_args("eagle", data, root / "out", root / "cache", "--epochs", "2", "--save-every", "1")
    assert main(args) == 0
    return root / "out", root / "cache", data


# ---------------------------------------------------------------- 3. outputs are never destructive

TRAINERS = ["eagle", "eagle3", "medusa", "ldlp"]


def occupied_out(case: str, tmp_path: Path, owner: str = "convert") -> Path:
    """An --out that must be refused, built in tmp_path; ``owner`` wrote "another command's output"."""
    if case == "model directory":
        return copy_dir(STORIES, tmp_path / "model")
    if case == "head directory":
        return copy_dir(EAGLE, tmp_path / "head")
    if case == "a file":
        (tmp_path / "file").write_text("keep me")
        return tmp_path / "file"
    if case == "under a file":
        (tmp_path / "file").write_text("keep me")
        return tmp_path / "file" / "out"
    if case == "other files":
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "todo.txt").write_text("keep me")
        return tmp_path / "notes"
    if case == "another command's output":
        prepare_output_dir(tmp_path / "theirs", owner)
        (tmp_path / "theirs" / "config.json").write_text("{}")
        return tmp_path / "theirs"
    if case == "read-only":
        if os.geteuid() == 0:  # root writes through permission bits; /proc takes no new files
            return Path("/proc/specula-hardening-test/out")
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        return tmp_path / "ro" / "out"
    raise AssertionError(case)


OUT_CASES = {"model directory": "a model or draft head", "head directory": "a model or draft head",
             "a file": "is a file", "under a file": "which is a file",
             "other files": "files it did not write (todo.txt)", "another command's output": "specula convert",
             "read-only": "cannot be written"}


@pytest.mark.parametrize("kind", TRAINERS)
@pytest.mark.parametrize("case", list(OUT_CASES))
def test_training_never_writes_into_an_out_it_does_not_own(kind, case, tmp_path, data_file, capsys):
    out = occupied_out(case, tmp_path)
    guarded = out if out.exists() else out.parent
    before = fingerprint(guarded)
    line = one_error(capsys, main(train_args(kind, data_file, out, tmp_path / "cache")))
    assert OUT_CASES[case] in line, line
    assert fingerprint(guarded) == before
    assert not (tmp_path / "cache").exists()  # refused before regenerating anything


@pytest.mark.parametrize("case", list(OUT_CASES))
def test_convert_never_writes_into_an_out_it_does_not_own(case, tmp_path, capsys):
    out = occupied_out(case, tmp_path, owner="train eagle3")
    guarded = out if out.exists() else out.parent
    before = fingerprint(guarded)
    line = one_error(capsys, main(["convert", "--draft", str(EAGLE3), "--to", "eagle3", "--out", str(out)]))
    assert OUT_CASES[case].replace("convert", "train eagle3") in line, line
    assert fingerprint(guarded) == before


def test_convert_may_rewrite_its_own_output(tmp_path):
    out = tmp_path / "converted"
    assert main(["convert", "--draft", str(EAGLE3), "--to", "eagle3", "--out", str(out)]) == 0
    assert main(["convert", "--draft", str(EAGLE3), "--to", "eagle3", "--out", str(out)]) == 0
    assert json.loads((out / MARKER).read_text())["kind"] == "convert"


def test_an_earlier_run_is_continued_only_with_resume(trained_run, tmp_path, capsys):
    out, cache, data = trained_run
    copy = copy_dir(out, tmp_path / "out")
    before = fingerprint(copy)
    line = one_error(capsys, main(train_args("eagle", data, copy, cache, "--epochs", "2", "--save-every", "1")))
    assert "add --resume" in line
    assert fingerprint(copy) == before


@pytest.mark.parametrize("case", ["empty dir", "new dir", "new nested dir", "own marker", "legacy run with resume"])
def test_prepare_output_dir_accepts_what_it_may_write(case, tmp_path):
    out = {"empty dir": tmp_path, "new dir": tmp_path / "a", "new nested dir": tmp_path / "a" / "b"}.get(
        case, tmp_path / "run")
    if case == "own marker":
        prepare_output_dir(out, "train eagle")
        (out / "evaluation.json").write_text("{}")
    if case == "legacy run with resume":
        (out / "checkpoint").mkdir(parents=True)
        (out / "checkpoint" / "trainer_state.pt").write_bytes(b"")
    assert prepare_output_dir(out, "train eagle", resume=True) == out
    assert json.loads((out / MARKER).read_text())["kind"] == "train eagle"


def test_prepare_output_dir_without_create_writes_nothing(tmp_path):
    prepare_output_dir(tmp_path / "new", "convert", create=False)
    assert not (tmp_path / "new").exists()


def test_an_interrupted_write_keeps_the_old_file_whole(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("old")

    def full_disk(tmp: str) -> None:
        Path(tmp).write_text("half of the ne")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(SpeculaError, match="cannot write .*results.json: No space left on device"):
        atomic_write(path, full_disk)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # no temporary left behind
    atomic_write_text(path, "new")
    assert path.read_text() == "new"


# ---------------------------------------------------------------- 4. training refuses to produce garbage

BAD_SETTINGS = {
    "lr nan": (["--lr", "nan"], "--lr"), "lr inf": (["--lr", "inf"], "--lr"), "lr negative": (["--lr", "-1"], "--lr"),
    "lr zero": (["--lr", "0"], "--lr"),
    "grad clip nan": (["--grad-clip", "nan"], "--grad-clip"), "grad clip inf": (["--grad-clip", "inf"], "--grad-clip"),
    "grad clip zero": (["--grad-clip", "0"], "--grad-clip"),
    "grad clip negative": (["--grad-clip", "-1"], "--grad-clip"),
    "warmup negative": (["--warmup-steps", "-5"], "--warmup-steps"),
    "gen temperature inf": (["--gen-temperature", "inf"], "--gen-temperature"),
    "gen temperature nan": (["--gen-temperature", "nan"], "--gen-temperature"),
    "gen temperature twice": (["--gen-temperature", "0,1,0"], "--gen-temperature"),
    "gen temperature list with inf": (["--gen-temperature", "0,inf"], "--gen-temperature"),
    "gen temperature list with a gap": (["--gen-temperature", "0,"], "--gen-temperature"),
}


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_settings_that_train_garbage_are_refused_before_any_work(case, tmp_path, data_file, capsys):
    extra, flag = BAD_SETTINGS[case]
    line = one_error(capsys, main(train_args("eagle", data_file, tmp_path / "out", tmp_path / "cache", *extra)))
    assert flag in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("penalty", ["nan", "inf", "-inf", "0.5"])
def test_a_non_finite_ldlp_penalty_is_refused(penalty, tmp_path, data_file, capsys):
    args = train_args("ldlp", data_file, tmp_path / "out", tmp_path / "cache", "--penalty", penalty)
    assert "--penalty" in one_error(capsys, main(args))
    assert not (tmp_path / "out").exists()


class TinyHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def tiny_dataset(count: int = 8) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.arange(3), "x": torch.randn(3, 4, generator=generator)} for _ in range(count)]


def save_tiny(model: nn.Module, directory: Path) -> None:
    torch.save(model.state_dict(), directory / "head.pt")


def poisoned_loss(poison: str, at_call: int):
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        out = model(batch["x"].float())[batch["valid"]]
        loss = out.pow(2).sum()
        if calls["n"] == at_call:
            if poison == "loss":
                loss = loss * math.nan
            else:  # a finite loss (0) whose gradient is not finite: d|w - w| at 0 times d sqrt at 0
                weight = model.linear.weight
                loss = loss + torch.sqrt((weight - weight.detach()).abs().sum())
        return loss, int(batch["valid"].sum()), {}

    return loss_fn


@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_a_non_finite_step_stops_training_and_keeps_the_last_good_checkpoint(poison, tmp_path):
    torch.manual_seed(0)
    config = TrainConfig(epochs=2, batch_size=2, lr=1e-2, warmup_steps=0, save_every=2)
    with pytest.raises(SpeculaError, match=f"diverged at step 5: the {poison}.*checkpoint of step 4 is kept"):
        run_training(TinyHead(), tiny_dataset(), poisoned_loss(poison, 5), config, tmp_path, save_tiny,
                     keys=("input_ids", "x"), log=lambda _: None, kind="train test")
    state = torch.load(tmp_path / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 4
    assert all(torch.isfinite(t).all() for t in torch.load(tmp_path / "checkpoint" / "head.pt").values())
    assert not (tmp_path / "head.pt").exists()  # no final head from a diverged run


def test_a_huge_learning_rate_never_saves_non_finite_weights(tmp_path):
    torch.manual_seed(0)
    config = TrainConfig(epochs=2, batch_size=2, lr=1e30, warmup_steps=0, save_every=1)
    with pytest.raises(SpeculaError, match="diverged at step 2: the loss is inf.*checkpoint of step 1 is kept"):
        run_training(TinyHead(), tiny_dataset(), poisoned_loss("none", -1), config, tmp_path, save_tiny,
                     keys=("input_ids", "x"), log=lambda _: None, kind="train test")
    assert all(torch.isfinite(t).all() for t in torch.load(tmp_path / "checkpoint" / "head.pt").values())


@pytest.mark.parametrize("field, value", [("lr", math.nan), ("lr", math.inf), ("grad_clip", 0.0),
                                          ("grad_clip", -0.5), ("weight_decay", math.nan), ("warmup_steps", -1),
                                          ("epochs", 0), ("batch_size", 2.5), ("mixed_precision", "fp8")])
def test_train_config_refuses_settings_that_train_garbage(field, value):
    with pytest.raises(SpeculaError, match=field):
        TrainConfig(**{field: value})


@pytest.mark.parametrize("damage", ["truncated", "not a trainer state"])
def test_a_damaged_checkpoint_on_resume_is_one_error_line(damage, trained_run, tmp_path, capsys):
    out, cache, data = trained_run
    copy = copy_dir(out, tmp_path / "out")
    state = copy / "checkpoint" / "trainer_state.pt"
    if damage == "truncated":
        truncate(state)
    else:
        torch.save([1, 2, 3], state)
    line = one_error(capsys, main(train_args("eagle", data, copy, cache, "--epochs", "2", "--save-every", "1",
                                             "--resume")))
    assert "trainer_state.pt" in line and "--out" in line, line


# ---------------------------------------------------------------- 6. Ctrl-C during training


def test_ctrl_c_says_what_was_kept_and_how_to_resume(tmp_path, monkeypatch, capsys):
    import specula.training.eagle_trainer as trainer

    data = write_records(tmp_path / "data.jsonl", 14)
    args = train_args("eagle", data, tmp_path / "out", tmp_path / "cache", "--epochs", "2", "--save-every", "1")
    original, calls = trainer.eagle_loss, {"n": 0}

    def interrupted_loss(target, noise=0.1):
        inner = original(target, noise)

        def loss_fn(head, batch):
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt
            return inner(head, batch)

        return loss_fn

    monkeypatch.setattr(trainer, "eagle_loss", interrupted_loss)
    assert main(args) == 130
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "checkpoint of step 2 is kept" in lines[0] and "--resume" in lines[0]
    monkeypatch.setattr(trainer, "eagle_loss", original)
    assert main([*args, "--resume"]) == 0
    assert "resumed from step 2" in capsys.readouterr().err


# ---------------------------------------------------------------- 5. one generation per Speculator at a time


@pytest.fixture(scope="module")
def speculator():
    return specula.load(STORIES, method="pld", dtype="float32")


def test_a_second_concurrent_stream_is_refused(speculator):
    first = speculator.stream(PROMPT, max_new_tokens=8)
    next(first)
    with pytest.raises(SpeculaError, match="already generating"):
        next(speculator.stream("The little bird", max_new_tokens=8))
    with pytest.raises(SpeculaError, match="already generating"):
        speculator.generate("The little bird", max_new_tokens=8)
    rest = [t for chunk in first for t in chunk.token_ids]
    assert rest  # the first stream is unharmed and finishes
    assert speculator.generate("The little bird", max_new_tokens=8).token_ids  # and frees the Speculator


def test_closing_a_stream_frees_the_speculator(speculator):
    expected = speculator.generate(PROMPT, max_new_tokens=12).token_ids
    first = speculator.stream(PROMPT, max_new_tokens=12)
    next(first)
    first.close()
    assert speculator.generate(PROMPT, max_new_tokens=12).token_ids == expected


def test_a_stream_that_fails_frees_the_speculator(speculator):
    with pytest.raises(SpeculaError):
        next(speculator.stream(PROMPT, max_new_tokens=0))
    assert speculator.generate(PROMPT, max_new_tokens=4).token_ids


# ---------------------------------------------------------------- 2. the context limit is exact

CONTEXT = 40
NEAR_METHODS = {
    "vanilla": ("vanilla", {}), "sps": ("sps", {"draft": LLAMA2XS, "num_tokens": 4}),
    "pld": ("pld", {"num_tokens": 8}), "eagle": ("eagle", {"draft": EAGLE}), "eagle2": ("eagle2", {"draft": EAGLE}),
    "eagle3": ("eagle3", {"draft": EAGLE3}), "medusa": ("medusa", {"draft": MEDUSA}),
    "ada": ("ada", {"draft": EAGLE}), "ada tree": ("ada", {"draft": EAGLE, "tree": True}),
}


@pytest.fixture(scope="module")
def near_context():
    """(prompt ids longer than CONTEXT, vanilla speculator limited to CONTEXT tokens).

    The text repeats itself so that prompt lookup, too, finds drafts to accept near the limit.
    """
    ids = specula.load(STORIES, dtype="float32").encode(" ".join(["Lily saw a big dog."] * 8))
    assert len(ids) > CONTEXT
    return ids, specula.load(STORIES, dtype="float32", max_length=CONTEXT)


@pytest.mark.parametrize("name", list(NEAR_METHODS))
def test_at_the_context_limit_every_method_equals_vanilla(name, near_context):
    ids, vanilla = near_context
    method, options = NEAR_METHODS[name]
    # Drafts verified whole: on this tiny target a head or draft model step costs about a target step, and the draft
    # budget would rightly stop drafting, leaving nothing near the limit to test.
    speculator = specula.load(STORIES, method=method, dtype="float32", max_length=CONTEXT, draft_budget="off",
                              **options)
    drafted = 0
    for length in range(CONTEXT - 12, CONTEXT):
        prompt = ids[:length]
        expected = vanilla.generate(prompt, max_new_tokens=64, stop_on_eos=False).token_ids
        result = speculator.generate(prompt, max_new_tokens=64, stop_on_eos=False)
        assert result.token_ids == expected, f"{name} with a prompt of {length} tokens"
        assert length + len(result.token_ids) == CONTEXT and result.stats.stop_reason == "context_length"
        drafted += sum(result.stats.accepted_lengths)
        sampled = speculator.generate(prompt, max_new_tokens=64, stop_on_eos=False, temperature=0.9, seed=length)
        assert length + len(sampled.token_ids) <= CONTEXT
    if name != "vanilla":
        assert drafted > 0, f"{name} never accepted a draft near the limit, so the test proved little"


@pytest.mark.parametrize("results, message", [
    ([], "no 'records' list"), ({"records": {"a": 1}}, "no 'records' list"),
    ({"records": [1, 2]}, "not JSON objects"), ({"records": [], "settings": [1]}, "not JSON objects"),
])
def test_bench_results_of_the_wrong_type_are_one_error_line(results, message, tmp_path, capsys):
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": "q", "category": "story", "prompt": PROMPT}) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(results))
    before = fingerprint(out)
    line = one_error(capsys, main(["bench", "--target", str(STORIES), "--methods", "vanilla", "--data", str(questions),
                                   "--max-new-tokens", "4", "--threads", "1", "--out", str(out), "--no-progress",
                                   "--no-profile"]))
    assert message in line, line
    assert fingerprint(out) == before
