"""`nats export`: a trained run as a from_pretrained folder with layer lists and a README."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from nats import ConfigError, NatsConfig, NatsForCausalLM
from nats.cli import main
from nats.trainers import TrainConfig, build_batches, latest_checkpoint, train
from nats.trainers.export import export_architecture, export_model
from nats.trainers.routing_maps import routing_figure

LAYERS = ("nats", "softmax", "nats")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A micro copy-task run of 3 layers (NAtS-L, softmax, NAtS-L), a few CPU steps."""
    out = tmp_path_factory.mktemp("export") / "run"
    model = NatsConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2,
                       softmax_heads_per_head=2, head_dim_k=16, head_dim_v=16, chunk_size=16,
                       layer_types=LAYERS)
    train(TrainConfig(model=model, task="copy", steps=4, batch_size=2, seq_len=33, lr=3e-3,
                      warmup_steps=2, eval_interval=4, eval_batches=2, log_interval=1,
                      checkpoint_interval=100, copy_symbols=8, device="cpu",
                      out_dir=str(out)))
    return out


def _eval_batches(run: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    config = TrainConfig.from_dict(json.loads((run / "train_config.json").read_text()))
    return build_batches(config).eval(config.eval_batches)


def _logits(model: NatsForCausalLM, run: Path) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(_eval_batches(run)[0][0]).logits


def _fractions_from_routes(model: NatsForCausalLM, batches) -> dict[int, list[float]]:
    """Per NAtS-L layer and head, the share of tokens in softmax chunks, counted by
    spreading each chunk's route over its tokens (independent of nats.analysis)."""
    c = model.config.chunk_size
    sm: dict[int, torch.Tensor] = {}
    total = 0
    with torch.no_grad():
        for ids, _ in batches:
            for i, routes in enumerate(model.eval()(ids).routes):
                if routes is not None:
                    per_token = routes[..., 0].double().repeat_interleave(c, 1)[:, : ids.shape[1]]
                    sm[i] = sm.get(i, 0) + per_token.sum((0, 1))
            total += ids.numel()
    return {i: (s / total).tolist() for i, s in sm.items()}


def _readme_row(readme: str, layer: int) -> str:
    (row,) = [line for line in readme.splitlines() if line.startswith(f"| {layer} | ")]
    return row


def test_layer_lists_in_config_dicts() -> None:
    cfg = NatsConfig(n_layers=4, layer_types=("nats", "softmax", "linear", "softmax"))
    d = cfg.to_dict()
    assert (d["softmax_layers"], d["linear_layers"], d["hybrid_layers"]) == ([1, 3], [2], [0])
    assert NatsConfig.from_dict(d) == cfg
    old = {k: v for k, v in d.items()  # saved before the lists
           if k not in ("softmax_layers", "linear_layers", "hybrid_layers")}
    assert NatsConfig.from_dict(old) == cfg
    with pytest.raises(ConfigError, match=r"NatsConfig\.softmax_layers = \[1\] .*\[1, 3\]"):
        NatsConfig.from_dict({**d, "softmax_layers": [1]})
    with pytest.raises(ConfigError, match=r"NatsConfig\.hybrid_layers = 0 "):
        NatsConfig.from_dict({**d, "hybrid_layers": 0})
    with pytest.raises(ConfigError, match=r"unknown NatsConfig field\(s\) \['attn_layers'\]"):
        NatsConfig.from_dict({**d, "attn_layers": [1]})


def test_export_of_a_run_loads_with_the_same_logits(run: Path, tmp_path: Path) -> None:
    result = export_architecture(run, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == \
        ["README.md", "config.json", "model.safetensors", "routing_map.png", "training.json"]
    assert result.origin == f"run {run} (model/, step 4)" and not result.converted
    loaded = NatsForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.config.layer_types == LAYERS
    assert torch.equal(_logits(loaded, run),
                       _logits(NatsForCausalLM.from_pretrained(run / "model"), run))
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (saved["softmax_layers"], saved["linear_layers"], saved["hybrid_layers"]) == \
        ([1], [], [0, 2])


def test_export_draws_the_routes_of_the_first_evaluation_sequence(run: Path,
                                                                  tmp_path: Path) -> None:
    result = export_architecture(run, tmp_path / "out")
    assert result.routing_map == tmp_path / "out" / "routing_map.png"
    ids = _eval_batches(run)[0][0][:1]
    with torch.no_grad():
        routes = NatsForCausalLM.from_pretrained(run / "model").eval()(ids).routes
    expected = routing_figure(routes, LAYERS, 16, ids.shape[1], title="routes of the first "
                              f"evaluation sequence ({ids.shape[1]} tokens)")
    with Image.open(result.routing_map) as drawn:
        assert np.array_equal(np.asarray(drawn.convert("RGB")),
                              np.asarray(expected.convert("RGB")))
    assert "`routing_map.png`" in result.readme.read_text()
    # A model without routes, exported over it, leaves no picture of the old one.
    plain = NatsForCausalLM(NatsConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2,
                                       head_dim_k=16, head_dim_v=16, chunk_size=16,
                                       layer_types=("linear",)))
    again = export_model(plain, tmp_path / "out", eval_batches=_eval_batches(run), force=True)
    assert again.routing_map is None and not (tmp_path / "out" / "routing_map.png").exists()


def test_readme_reports_each_layers_measured_fraction(run: Path, tmp_path: Path) -> None:
    result = export_architecture(run, tmp_path / "out")
    expected = _fractions_from_routes(NatsForCausalLM.from_pretrained(run / "model"),
                                      _eval_batches(run))
    assert sorted(result.fractions) == sorted(expected) == [0, 2]
    readme = result.readme.read_text()
    for i, per_head in expected.items():
        assert list(result.fractions[i].per_head) == pytest.approx(per_head, abs=1e-12)
        row = _readme_row(readme, i)
        assert row.startswith(f"| {i} | nats | nats | {', '.join(f'{x:.3f}' for x in per_head)}"
                              f" | {sum(per_head) / len(per_head):.3f} | ")
    assert _readme_row(readme, 1).startswith("| 1 | softmax | softmax | (no routes) | 1.000 |")
    for needle in ("chunk size | 16 tokens", "2 routing heads", "d_model | 32",
                   f"parameters | {result.parameters:,}", f"run {run} (model/, step 4)",
                   "2 evaluation batch(es) of 2 x 33 tokens", '"softmax_layers": [1]',
                   "from_pretrained(", "--init-from"):
        assert needle in readme, needle


def test_no_weights_writes_config_and_readme_only(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    export_architecture(run, out)
    result = export_architecture(run, out, weights=False, force=True)  # replaces the weights
    assert result.weights is None
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json",
                                                     "routing_map.png", "training.json"]
    config = NatsConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert config == NatsForCausalLM.from_pretrained(run / "model").config
    readme = result.readme.read_text()
    assert "not exported" in readme and "--init-from" not in readme


def test_the_export_carries_the_task_it_was_trained_on(run: Path, tmp_path: Path) -> None:
    from nats.trainers import run_config
    from nats.trainers.sources import load_model

    result = export_architecture(run, tmp_path / "out")
    trained = TrainConfig.from_dict(json.loads((run / "train_config.json").read_text()))
    carried = TrainConfig.from_dict(json.loads(result.training.read_text()))
    assert carried.task == trained.task == "copy" and carried.copy_symbols == 8
    assert carried.model == result.config and carried.seq_len == trained.seq_len
    # The retraining command the README prints keeps the task (the preset's is another).
    readme = result.readme.read_text()
    assert f"nats train --config {result.training} --out runs/out --init-from" in readme
    again = run_config("mqar-tiny", {"init_from": str(result.out_dir)}, resume=False,
                       config_path=str(result.training))
    assert again.task == "copy" and again.model == result.config
    # nats eval evaluates the export on its own task.
    assert load_model(result.out_dir, torch.device("cpu")).train_config.task == "copy"


def test_readme_of_a_plain_stack_claims_no_routes(tmp_path: Path) -> None:
    config = NatsConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2,
                        softmax_heads_per_head=2, head_dim_k=16, head_dim_v=16, chunk_size=16,
                        layer_types=("softmax", "linear"))
    batches = [(torch.randint(0, 40, (2, 40)), torch.randint(0, 40, (2, 40)))]
    result = export_model(NatsForCausalLM(config), tmp_path / "out", eval_batches=batches)
    readme = result.readme.read_text()
    assert readme.startswith("# Architecture export: 2 layers")
    assert "No layer routes" in readme and "not measured" not in readme
    assert result.training is None and "training run is unknown" in readme


def test_plain_layers_replace_exactly_the_one_way_layers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = NatsConfig(vocab_size=40, d_model=32, n_layers=5, n_heads=2,
                        softmax_heads_per_head=2, head_dim_k=16, head_dim_v=16, chunk_size=16,
                        layer_types=("nats", "softmax", "nats", "linear", "nats"))
    model = NatsForCausalLM(config)
    for layer, override in zip(model.nats_layers, ("softmax", "linear", 0.5), strict=True):
        layer.route_override = override  # layers 0, 2, 4
    batches = [(torch.randint(0, 40, (2, 40)), None)]
    rng = torch.get_rng_state()
    result = export_model(model, tmp_path / "out", eval_batches=batches, plain_layers=True)
    assert torch.equal(torch.get_rng_state(), rng)  # the fresh init used its own seed
    assert {i: f.kind for i, f in result.fractions.items()} == \
        {0: "all-softmax", 2: "all-linear", 4: "mixed"}
    assert result.converted == {0: "softmax", 2: "linear"}
    assert result.config.layer_types == ("softmax", "softmax", "linear", "linear", "nats")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (saved["softmax_layers"], saved["linear_layers"], saved["hybrid_layers"]) == \
        ([0, 1], [2, 3], [4])

    loaded = NatsForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    trained = model.state_dict()
    fresh = [k for k in loaded if k.startswith(("blocks.0.mixer.", "blocks.2.mixer."))]
    assert sorted(fresh) == sorted(result.fresh) and fresh
    carried = [k for k in loaded if k not in fresh]
    assert sorted(carried) == sorted(result.carried)
    assert any(k.startswith("blocks.0.mlp") for k in carried)  # norms, MLPs stay trained
    for k in carried:
        assert torch.equal(loaded[k], trained[k]), k  # bit-exact
    assert not any(k.startswith("blocks.0.mixer.scorer") for k in loaded)
    readme = result.readme.read_text()
    assert "freshly initialised" in readme
    assert "layer 0 routed every chunk to softmax attention and is exported as a plain " \
        "softmax layer; layer 2 routed every chunk to linear attention and is exported as " \
        "a plain Gated DeltaNet layer." in readme
    assert _readme_row(readme, 2).startswith("| 2 | nats | linear | 0.000, 0.000 | 0.000 |")

    again = export_model(model, tmp_path / "again", eval_batches=batches, plain_layers=True)
    again_state = NatsForCausalLM.from_pretrained(tmp_path / "again").state_dict()
    assert all(torch.equal(again_state[k], loaded[k]) for k in again.fresh)  # seeded


def test_plain_layers_of_a_run_folder(run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    model = NatsForCausalLM.from_pretrained(copy / "model")
    with torch.no_grad():  # a budget bias far above every score: every chunk to softmax
        model.blocks[0].mixer.budget.route_bias.fill_(1e4)
    model.save_pretrained(copy / "model")
    expected = _fractions_from_routes(model, _eval_batches(copy))
    assert expected[0] == [1.0, 1.0]
    one_way = {i: {1.0: "softmax", 0.0: "linear"}[f[0]] for i, f in expected.items()
               if len(set(f)) == 1 and f[0] in (0.0, 1.0)}

    result = export_architecture(copy, tmp_path / "out", plain_layers=True)
    assert result.origin == f"run {copy} (model/, final model)"  # differs from the checkpoint
    assert result.converted == one_way and result.converted[0] == "softmax"
    loaded = NatsForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.config.layer_types[0] == "softmax"
    trained, state = model.state_dict(), loaded.state_dict()
    for k in result.carried:
        assert torch.equal(state[k], trained[k]), k


def test_checkpoint_file_and_a_run_without_model_dir(run: Path, tmp_path: Path) -> None:
    checkpoint = latest_checkpoint(run)
    result = export_architecture(checkpoint, tmp_path / "a")
    assert result.origin == f"checkpoint {checkpoint}, step 4"
    reference = _logits(NatsForCausalLM.from_pretrained(run / "model"), run)
    assert torch.equal(_logits(NatsForCausalLM.from_pretrained(tmp_path / "a"), run), reference)

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("model"))
    result = export_architecture(copy, tmp_path / "b", eval_batches=0)
    assert result.origin == f"run {copy} (newest checkpoint), step 4" and not result.fractions
    assert "not measured" in result.readme.read_text()
    assert torch.equal(_logits(NatsForCausalLM.from_pretrained(tmp_path / "b"), run), reference)


@pytest.mark.parametrize("cut", ["weights missing", "weights truncated", "empty",
                                 "config garbled"])
def test_a_model_folder_cut_short_gives_way_to_the_checkpoint(run: Path, tmp_path: Path,
                                                              cut: str, capsys) -> None:
    """A run killed between ``model/``'s two files (its config is written first), or whose
    ``model/`` is damaged, is exported from its newest checkpoint, which holds the model."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    weights = copy / "model" / "model.safetensors"
    if cut == "weights missing":
        weights.unlink()
    elif cut == "weights truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    elif cut == "config garbled":
        (copy / "model" / "config.json").write_text("{\n")
    else:
        shutil.rmtree(copy / "model")
        (copy / "model").mkdir()
    result = export_architecture(copy, tmp_path / "a", eval_batches=0)
    assert result.origin == (f"run {copy} (newest checkpoint; model/ incomplete or "
                             "unreadable), step 4")
    assert "nats: warning: " in capsys.readouterr().err
    reference = _logits(NatsForCausalLM.from_pretrained(run / "model"), run)
    assert torch.equal(_logits(NatsForCausalLM.from_pretrained(tmp_path / "a"), run), reference)


def test_a_hand_edited_model_folder_is_not_replaced_by_the_checkpoint(run: Path,
                                                                     tmp_path: Path) -> None:
    """A whole ``model/`` whose config no longer loads is the user's error to see, not a
    reason to switch silently to the checkpoint."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    config = json.loads((copy / "model" / "config.json").read_text())
    (copy / "model" / "config.json").write_text(json.dumps({**config, "chunk_size": 7}))
    with pytest.raises(ValueError, match="chunk_size"):
        export_architecture(copy, tmp_path / "a", eval_batches=0)


def test_refusals(run: Path, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"is not empty; .* --force"):
        export_architecture(run, tmp_path / "full")
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    for protected in (run, run / "model", run / "checkpoints"):
        with pytest.raises(ValueError, match="is the run being exported"):
            export_architecture(run, protected, force=True)
    with pytest.raises(ValueError, match="plain layers need measured routes"):
        export_architecture(run, tmp_path / "x", plain_layers=True, eval_batches=0)
    with pytest.raises(ValueError, match="eval_batches must be an integer >= 0"):
        export_architecture(run, tmp_path / "x", eval_batches=-1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_architecture(tmp_path / "nothing", tmp_path / "x")
    with pytest.raises(ValueError, match="neither a run folder"):
        export_architecture(tmp_path / "full", tmp_path / "x")
    NatsForCausalLM.from_pretrained(run / "model").save_pretrained(tmp_path / "saved")
    with pytest.raises(ValueError, match="no record of its training run"):
        export_architecture(tmp_path / "saved", tmp_path / "x")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    save_file({"w": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
    for bad in ("junk.safetensors", "plain.safetensors"):
        with pytest.raises(ValueError, match=r"cannot be read|is not a nats checkpoint"):
            export_architecture(tmp_path / bad, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_cli_export(run: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out), "--plain-layers"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"nats: exported run {run} (model/, step 4)\n")
    assert "  layer 0: nats" in printed and "  layer 1: softmax\n" in printed
    assert (f"wrote config.json, model.safetensors, training.json, routing_map.png, "
            f"README.md to {out}") in printed

    assert main(["export", str(run), "--out", str(out)]) == 2  # not empty
    err = capsys.readouterr().err
    assert err.startswith("nats: error: --out ") and err.count("\n") == 1
    assert main(["export", str(run), "--out", str(out), "--force", "--no-weights",
                 "--eval-batches", "1"]) == 0
    assert "wrote config.json, training.json, routing_map.png, README.md" in \
        capsys.readouterr().out
    assert not (out / "model.safetensors").exists()


def test_an_export_cut_short_leaves_the_folder_as_it_was(run: Path, tmp_path: Path,
                                                          monkeypatch) -> None:
    """Ctrl-C after the weights were written: no half model folder, no staging folder,
    and an earlier export that ``--force`` was replacing is whole."""
    import nats.trainers.export as export

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    earlier = export_architecture(run, tmp_path / "old")
    before = {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()}
    monkeypatch.setattr(export, "render_readme", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_architecture(run, tmp_path / "new")
    with pytest.raises(KeyboardInterrupt):
        export_architecture(run, tmp_path / "old", force=True, weights=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()} == before
    assert earlier.weights is not None and earlier.weights.is_file()


def test_force_over_an_earlier_export_keeps_other_files_and_drops_stale_ones(
        run: Path, tmp_path: Path) -> None:
    export_architecture(run, tmp_path / "e")
    (tmp_path / "e" / "notes.txt").write_text("mine")
    result = export_architecture(run, tmp_path / "e", force=True, weights=False)
    names = sorted(p.name for p in (tmp_path / "e").iterdir())
    assert "model.safetensors" not in names and "notes.txt" in names and result.weights is None
    assert result.readme.is_file() and result.readme.parent == tmp_path / "e"


def test_a_run_resumed_past_its_model_folder_exports_its_newest_checkpoint(
        run: Path, tmp_path: Path) -> None:
    """A finished run resumed for more steps and stopped: its ``model/`` is the earlier
    end, its newest checkpoint (other weights, written later) the model."""
    from nats.trainers.checkpoint import save_checkpoint
    from nats.trainers.optim import build_optimizer

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    config = TrainConfig.from_dict(json.loads((copy / "train_config.json").read_text()))
    later = NatsForCausalLM.from_pretrained(copy / "model")
    with torch.no_grad():
        later.embed.weight.mul_(1.5)
    path = save_checkpoint(copy, 7, later, build_optimizer(later, config), config.to_dict(), 5)
    weights = copy / "model" / "model.safetensors"
    os.utime(path, (weights.stat().st_atime, weights.stat().st_mtime + 10))
    result = export_architecture(copy, tmp_path / "out", eval_batches=0)
    assert result.origin == f"run {copy} (newest checkpoint, newer than model/), step 7"
    assert torch.equal(_logits(NatsForCausalLM.from_pretrained(tmp_path / "out"), run),
                       _logits(later, run))


def test_damaged_sources_are_refused_in_one_line(run: Path, tmp_path: Path) -> None:
    """A checkpoint whose tensor bytes changed (its digest), a checkpoint whose config
    does not describe its tensors, a run config that is not an object; a truncated newest
    checkpoint beside ``model/`` leaves ``model/`` the model."""
    from safetensors import safe_open

    checkpoint = latest_checkpoint(run)
    flipped = tmp_path / "flipped.safetensors"
    data = bytearray(checkpoint.read_bytes())
    data[-5] ^= 0x40  # inside the last tensor's bytes
    flipped.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="fails its digest"):
        export_architecture(flipped, tmp_path / "a")

    with safe_open(str(checkpoint), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(checkpoint))
    nats_meta = json.loads(meta["nats"])
    nats_meta["config"]["model"]["mlp_ratio"] = 8.0
    other = tmp_path / "other.safetensors"
    save_file(tensors, str(other), metadata={**meta, "nats": json.dumps(nats_meta)})
    with pytest.raises(ValueError, match="does not hold the model its config describes"):
        export_architecture(other, tmp_path / "b")

    listed = tmp_path / "listed"
    shutil.copytree(run, listed)
    (listed / "train_config.json").write_text("[]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        export_architecture(listed, tmp_path / "c")

    cut = tmp_path / "cut"
    shutil.copytree(run, cut)
    newest = latest_checkpoint(cut)
    newest.write_bytes(newest.read_bytes()[:300])
    result = export_architecture(cut, tmp_path / "d", eval_batches=0)
    assert result.origin == f"run {cut} (model/, final model)"
    for name in "abc":
        assert not (tmp_path / name).exists()

    flipped_run = tmp_path / "flipped-run"  # a damaged newer checkpoint: model/ is whole
    shutil.copytree(run, flipped_run)
    newest = latest_checkpoint(flipped_run)
    data = bytearray(newest.read_bytes())
    header = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8:8 + header])["model/norm.weight"]["data_offsets"]
    data[8 + header + begin + 1] ^= 0x40  # a model weight, so it differs from model/'s
    newest.write_bytes(bytes(data))
    weights = flipped_run / "model" / "model.safetensors"
    os.utime(newest, (weights.stat().st_atime, weights.stat().st_mtime + 10))
    result = export_architecture(flipped_run, tmp_path / "e", eval_batches=0)
    assert "step_00000004.safetensors is damaged" in result.origin
    assert torch.equal(_logits(NatsForCausalLM.from_pretrained(tmp_path / "e"), run),
                       _logits(NatsForCausalLM.from_pretrained(run / "model"), run))


def test_an_export_folder_is_made_as_mkdir_makes_one_and_kept_when_given(
        run: Path, tmp_path: Path) -> None:
    """A new ``--out`` gets the umask's permissions; an existing one (here 0750, behind a
    symbolic link) keeps its own and receives the files."""
    (tmp_path / "plain").mkdir()
    export_architecture(run, tmp_path / "new", eval_batches=0)
    assert (tmp_path / "new").stat().st_mode & 0o777 == \
        (tmp_path / "plain").stat().st_mode & 0o777
    (tmp_path / "given").mkdir(mode=0o750)
    (tmp_path / "given").chmod(0o750)
    (tmp_path / "link").symlink_to(tmp_path / "given")
    export_architecture(run, tmp_path / "link", eval_batches=0)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "given").stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in (tmp_path / "given").iterdir()) == \
        ["README.md", "config.json", "model.safetensors", "training.json"]


def test_a_run_without_model_folder_skips_a_damaged_newest_checkpoint(
        run: Path, tmp_path: Path, capsys) -> None:
    """As resuming does: the newest checkpoint that loads whole is the model, with a
    warning naming the skipped one; with none whole, the newest one's error."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("model"))
    newest = latest_checkpoint(copy)
    older = newest.with_name("step_00000002.safetensors")
    shutil.copyfile(newest, older)  # an intact earlier save (of the same weights)
    newest.write_bytes(newest.read_bytes()[:300])
    result = export_architecture(copy, tmp_path / "a", eval_batches=0)
    assert result.origin == f"run {copy} (newest whole checkpoint), step 4"
    assert f"skipping checkpoint {newest.name}" in capsys.readouterr().err
    reference = _logits(NatsForCausalLM.from_pretrained(run / "model"), run)
    assert torch.equal(_logits(NatsForCausalLM.from_pretrained(tmp_path / "a"), run), reference)
    older.unlink()
    with pytest.raises(ValueError, match=newest.name):
        export_architecture(copy, tmp_path / "b", eval_batches=0)
    assert "skipping" not in capsys.readouterr().err


def test_an_export_with_a_damaged_training_file_still_loads(run: Path, tmp_path: Path,
                                                            capsys) -> None:
    """The model is whole; only the record of the run that trained it is damaged: it loads
    without its run (as a model folder would), with a warning, not an error."""
    from nats.trainers.sources import load_model

    export_architecture(run, tmp_path / "e", eval_batches=0)
    (tmp_path / "e" / "training.json").write_text("[")
    loaded = load_model(tmp_path / "e", "cpu")
    assert loaded.train_config is None and loaded.origin == f"model folder {tmp_path / 'e'}"
    assert "not valid JSON" in capsys.readouterr().err
    reference = _logits(NatsForCausalLM.from_pretrained(run / "model"), run)
    assert torch.equal(_logits(loaded.model, run), reference)


def test_an_export_into_a_folder_another_export_holds_is_refused(run: Path,
                                                                 tmp_path: Path) -> None:
    """Two exports into one folder at once: the second is refused and leaves the first's
    staging folder alone (it used to delete every staging folder it found there)."""
    from nats.folder_lock import FolderBusy, exclusive
    from nats.trainers.export import STAGING_PREFIX

    out = tmp_path / "out"
    live_stage = out / f"{STAGING_PREFIX}1-live"
    with exclusive(out, "export folder"):
        live_stage.mkdir()
        with pytest.raises(FolderBusy, match=f"export folder {out} is in use by process "
                                             f"{os.getpid()}"):
            export_architecture(run, out, eval_batches=0)
        assert live_stage.is_dir()


def test_what_a_killed_export_left_is_cleared(run: Path, tmp_path: Path) -> None:
    """A lock file and a staging folder of an export killed outright neither make the
    folder count as full nor stay behind."""
    from nats.folder_lock import LOCK_FILE
    from nats.trainers.export import STAGING_PREFIX

    out = tmp_path / "out"
    (out / f"{STAGING_PREFIX}99-dead").mkdir(parents=True)
    (out / LOCK_FILE).write_text("99\n")
    export_architecture(run, out, eval_batches=0)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json",
                                                     "model.safetensors", "training.json"]


def test_the_config_is_moved_in_last(run: Path, tmp_path: Path, monkeypatch) -> None:
    """A folder with a new config.json beside the old weights would load as a model:
    the config follows the weights."""
    out = tmp_path / "out"
    moved: list[str] = []
    replace = os.replace

    def recording(src, dst) -> None:
        if Path(dst).parent == out:
            moved.append(Path(dst).name)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", recording)
    export_architecture(run, out, eval_batches=0)
    assert moved[-1] == "config.json" and "model.safetensors" in moved


def test_an_export_killed_while_moving_in_leaves_no_mismatched_model(
        run: Path, tmp_path: Path, monkeypatch) -> None:
    """Killed after the new weights are in but before the new config: the earlier
    export's config must not stay beside them (it would load them as its model)."""
    out = tmp_path / "out"
    export_architecture(run, out, eval_batches=0)
    replace = os.replace

    def killed_after_the_weights(src, dst) -> None:
        replace(src, dst)
        if Path(dst) == out / "model.safetensors":
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed_after_the_weights)
    with pytest.raises(KeyboardInterrupt):
        export_architecture(run, out, eval_batches=0, force=True)
    monkeypatch.setattr(os, "replace", replace)
    assert (out / "model.safetensors").is_file() and not (out / "config.json").exists()
    export_architecture(run, out, eval_batches=0, force=True)
    assert (out / "config.json").is_file()
